"""Switching a loaded model's attention implementation for one forward.

    with use_attention(model, "gyre_tree"):   # any name registered in transformers' AttentionInterface
        model(...)

The trainer's tree kernel (engines/train/tree_attention.py) and the engine's flash prefill
(engines/rollout/attention.py) each register a function and route a model's layers to it this way;
the model's own implementation is back after the block (a backward that replays the recorded graph
may run after it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def use_attention(model: torch.nn.Module, implementation: str) -> Iterator[None]:
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = previous
