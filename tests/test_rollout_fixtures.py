"""Shared pieces of the rollout tests: a tiny random policy with varied greedy outputs, and one CPU
thread (a 32-wide model is fastest single-threaded; on a busy 2-core host, two threads spin)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 64


def tiny_qwen2(
    vocab: int = VOCAB, max_positions: int = 1024, attn: str = "sdpa", **config: Any
) -> Qwen2ForCausalLM:
    """The tests' model shape: a 2-layer, 32-wide Qwen2 with tied embeddings, in float32, initialised
    from torch's current seed; ``config``: other Qwen2Config fields, or these ones changed."""
    shape = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    shape |= {"intermediate_size": 64, "tie_word_embeddings": True, **config}
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab, max_position_embeddings=max_positions, attn_implementation=attn, **shape
        )
    ).float()


def tiny_policy(seed: int = 0, max_positions: int = 1024, attn: str = "sdpa") -> Qwen2ForCausalLM:
    """tiny_qwen2 with a wider init, so greedy outputs are not one token repeated (the default 0.02 init
    makes the model nearly uniform)."""
    torch.manual_seed(seed)
    return tiny_qwen2(VOCAB, max_positions, attn, initializer_range=0.3).eval()


def perturbed_state(model: torch.nn.Module, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """The model's weights plus noise: "the next policy version"."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        for name, tensor in model.state_dict().items()
    }


@contextlib.contextmanager
def one_cpu_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
