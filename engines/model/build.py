"""Builds a policy model from a `ModelConfig`: its family's config (Qwen2 by default; Qwen3, Llama or
Mistral with ``family``), seeded random weights, HF-format folder.

`init_model` is the whole of ``gyre model init``: check the destination, train the tokenizer, build
the model, save both into a local temporary folder, then publish the files to the destination (any
fsspec URL). Weights are drawn per parameter from a torch generator seeded by (seed, parameter
name), so they depend on neither module iteration order nor global RNG state: the same config
gives byte-identical safetensors on every run.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.initialization import no_init_weights

from engines.model.chat import ENDOFTEXT
from engines.model.config import ModelConfig
from engines.model.families import FAMILIES
from engines.model.storage import check_destination, publish_folder
from engines.model.tokenizer import build_tokenizer, save_tokenizer

ATTN_IMPLEMENTATION = "sdpa"


@dataclass(frozen=True)
class InitResult:
    """What `init_model` wrote."""

    out: str
    """the destination URL, as given"""
    preset: str
    family: str
    seed: int
    dtype: str
    parameters: int
    """number of distinct parameters (the tied output projection counts once)"""
    vocab_size: int
    files: list[str]
    """file names written, sorted"""


def _shared_config(config: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """What every family's transformers config is given alike: the preset's shape, the tokenizer's
    vocabulary, the init and the dtype."""
    shape = config.shape
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "tie_word_embeddings": shape.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": 1e-6,
        "attn_implementation": ATTN_IMPLEMENTATION,
        "dtype": config.resolved_dtype(),
    }


def qwen2_config(config: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    """The transformers config of ``config``'s preset, with the tokenizer's vocabulary and special ids."""
    endoftext = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    return Qwen2Config(
        **_shared_config(config, tokenizer),
        use_sliding_window=False,
        bos_token_id=endoftext,
        eos_token_id=endoftext,
    )


def family_config(config: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The transformers config of ``config``'s preset in its family's architecture (Qwen2: `qwen2_config`)."""
    if config.family == "qwen2":
        return qwen2_config(config, tokenizer)
    family, shape = FAMILIES[config.family], config.shape
    bos = tokenizer.convert_tokens_to_ids(family.bos or family.pad)
    extra = {"head_dim": shape.hidden_size // shape.num_attention_heads}
    if config.family == "qwen3":
        extra.update(use_sliding_window=False)
    if config.family == "mistral":
        extra.update(sliding_window=None)
    return AutoConfig.for_model(
        family.model_type,
        **_shared_config(config, tokenizer),
        bos_token_id=bos,
        eos_token_id=tokenizer.convert_tokens_to_ids(family.eos),
        pad_token_id=tokenizer.convert_tokens_to_ids(family.pad),
        **extra,
    )


def generation_config(tokenizer: PreTrainedTokenizerFast, family: str = "qwen2") -> GenerationConfig:
    """Stops at the end of a chat turn or of a document, like the family's instruct models."""
    chosen = FAMILIES[family]
    bos = tokenizer.convert_tokens_to_ids(chosen.bos or ENDOFTEXT)
    stops = [tokenizer.convert_tokens_to_ids(token) for token in chosen.stops]
    pad = tokenizer.convert_tokens_to_ids(chosen.pad)
    return GenerationConfig(bos_token_id=bos, eos_token_id=stops, pad_token_id=pad)


def build_model(config: ModelConfig, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A randomly initialized causal LM of ``config``'s family, in its dtype, in eval mode, on the CPU."""
    hf_config = family_config(config, tokenizer)
    with no_init_weights():  # every parameter is drawn below; skip transformers' own (global-RNG) init
        model = AutoModelForCausalLM.from_config(hf_config)
    model.tie_weights()  # init_weights, skipped above, is also what ties the output projection
    if hf_config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("the output projection is not tied to the embedding")
    initialize_weights(model, config.seed, config.initializer_range)
    model.generation_config = generation_config(tokenizer, config.family)
    return model.to(getattr(torch, config.resolved_dtype())).eval()


@torch.no_grad()
def initialize_weights(model: torch.nn.Module, seed: int, std: float) -> None:
    """Qwen2's (and Llama's) init (matrices ~ N(0, std), biases 0, RMSNorm scales 1), seeded per parameter name."""
    for name, parameter in model.named_parameters():  # a tied weight appears once, under its first name
        owner = model.get_submodule(name.rpartition(".")[0])
        if "RMSNorm" in type(owner).__name__:
            parameter.fill_(1.0)
        elif name.endswith(".bias"):
            parameter.zero_()
        elif isinstance(owner, torch.nn.Linear | torch.nn.Embedding):
            generator = torch.Generator().manual_seed(_parameter_seed(seed, name))
            parameter.normal_(0.0, std, generator=generator)
        else:
            raise ValueError(f"no init rule for parameter {name} of {type(owner).__name__}")


def _parameter_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def count_parameters(config: ModelConfig) -> int:
    """Distinct parameters of ``config``'s model, counted on the meta device (nothing is allocated)."""
    tokenizer = build_tokenizer(config.resolved_vocab_size(), family=config.family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config(config, tokenizer))
    return sum(p.numel() for p in model.parameters())


def save_model_folder(config: ModelConfig, folder: str | Path) -> tuple[int, int]:
    """Writes model + tokenizer into a local folder; returns (parameters, vocab size)."""
    tokenizer = build_tokenizer(config.resolved_vocab_size(), family=config.family)
    model = build_model(config, tokenizer)
    model.save_pretrained(folder)  # safetensors, one file up to 50 GB
    save_tokenizer(tokenizer, folder, config.family)
    return sum(p.numel() for p in model.parameters()), len(tokenizer)


def init_model(
    config: ModelConfig, out: str, *, force: bool = False, s3_endpoint_url: str | None = None
) -> InitResult:
    """Builds ``config``'s model and tokenizer and writes them to ``out`` (a folder or any fsspec URL).

    Refuses a destination that already holds files unless ``force``; with ``force``, model files
    already there are replaced and unrelated files are left alone.
    """
    check_destination(out, force=force, s3_endpoint_url=s3_endpoint_url)
    with tempfile.TemporaryDirectory(prefix="gyre-model-") as tmp:
        parameters, vocab_size = save_model_folder(config, tmp)
        files = publish_folder(tmp, out, force=force, s3_endpoint_url=s3_endpoint_url)
    return InitResult(
        out=out,
        preset=config.preset,
        family=config.family,
        seed=config.seed,
        dtype=config.resolved_dtype(),
        parameters=parameters,
        vocab_size=vocab_size,
        files=files,
    )
