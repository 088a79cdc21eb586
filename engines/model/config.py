"""Typed configuration of the policy model: which preset, which seed, which vocabulary and dtype.

A preset fixes the architecture (a Qwen2 decoder); `ModelConfig` picks one and may override the
tokenizer's vocabulary size and the dtype the weights are saved in. No torch or transformers
import here: configs travel through Prefect and the CLI cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from engines.model.families import FamilyName

PresetName = Literal["tiny", "small", "gpu-0.5b", "gpu-1.5b"]
DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class Preset:
    """The shape of one Qwen2 architecture (everything but the vocabulary, which the tokenizer sets)."""

    hidden_size: int
    """width of the residual stream"""
    num_hidden_layers: int
    """decoder layers"""
    num_attention_heads: int
    """query heads (head dim = hidden_size / num_attention_heads)"""
    num_key_value_heads: int
    """key/value heads (grouped-query attention)"""
    intermediate_size: int
    """width of the SwiGLU MLP"""
    rope_theta: float
    """RoPE base frequency"""
    vocab_size: int
    """default tokenizer vocabulary, special tokens included"""
    dtype: DType
    """default dtype of the saved weights"""
    max_position_embeddings: int = 32768
    """longest sequence the RoPE table is meant for"""
    tie_word_embeddings: bool = True
    """the output projection shares the input embedding"""
    purpose: str = ""
    """what the preset is for (shown in docs)"""


PRESETS: dict[str, Preset] = {  # hidden, layers, heads, kv heads, MLP width, RoPE base, vocabulary, dtype
    "tiny": Preset(
        256, 4, 4, 2, 384, 10_000.0, 4096, "float32", purpose="tests: a forward pass in milliseconds on CPU"
    ),
    "small": Preset(512, 12, 8, 2, 1536, 10_000.0, 8192, "float32", purpose="CPU benchmarks"),
    "gpu-0.5b": Preset(
        896, 24, 14, 2, 4864, 1e6, 8192, "bfloat16", purpose="one GPU: Qwen2.5-0.5B's shape, our vocabulary"
    ),
    "gpu-1.5b": Preset(
        1536, 28, 12, 2, 8960, 1e6, 8192, "bfloat16", purpose="GPUs: Qwen2.5-1.5B's shape, our vocabulary"
    ),
}


class ModelConfig(BaseModel):
    """Which policy model to initialize. The same config always gives the same weights and tokenizer."""

    preset: PresetName = Field("tiny", description="shape: " + ", ".join(PRESETS))
    family: FamilyName = Field(
        "qwen2",
        description="architecture, tokenizer control tokens and chat format (engines/model/families.py): "
        "qwen2, qwen3, llama, mistral",
    )
    seed: int = Field(0, ge=0, description="seed of the weight init (the tokenizer does not depend on it)")
    vocab_size: int | None = Field(
        None,
        ge=512,
        description="tokenizer vocabulary, special tokens included (default: the preset's); "
        "the model's embedding has exactly this many rows",
    )
    dtype: DType | None = Field(None, description="dtype of the saved weights (default: the preset's)")
    initializer_range: float = Field(0.02, gt=0, description="std of the normal init of every matrix")

    @property
    def shape(self) -> Preset:
        return PRESETS[self.preset]

    def resolved_vocab_size(self) -> int:
        return self.vocab_size or self.shape.vocab_size

    def resolved_dtype(self) -> DType:
        return self.dtype or self.shape.dtype
