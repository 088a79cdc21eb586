"""The engine's attention: a prefill chunk without a [chunk, context] mask on the CPU.

A prefill chunk of q tokens appended to a row that holds ``start`` tokens attends to every held token
and, causally, to itself. With a mask that costs a [q, start + q] float table per forward and, on
torch's math path, as many attention weights per head: about 40 KB a context token at chunks of
2,048, 5 GB at 134K. Here the chunk runs as two calls of torch's fused CPU flash-attention kernel,
which keeps only its tiles: the chunk against the held tokens (no mask: every pair is allowed), and
the chunk against itself (``is_causal``); the two are merged by their log-sum-exp, exactly as the
kernel merges its own tiles. Grouped-query heads are folded into rows for the first call (the query
heads that share a key head read the same keys) and the chunk's keys repeated for the second.

``ENGINE_ATTENTION`` is registered in transformers' AttentionInterface. The runner switches a CPU
model to it for each prefill (engines.model.attention.use_attention) and passes no mask (a model with
a custom attention and no mask builds none); decode steps keep the model's own attention and their
small 4D mask (one row of columns per running request).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

ENGINE_ATTENTION = "gyre_engine"

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_prefill_available(device: torch.device) -> bool:
    return device.type == "cpu" and _CPU_FLASH is not None


def prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries [1, H, q, D] at the last q positions of keys and values [1, Hk, start + q, D]; each
    query sees every key up to its own position. Returns [1, H, q, D]."""
    heads, q, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, total = key.shape[1], key.shape[2]
    group, start = heads // kv_heads, total - q
    if query.shape[0] != 1 or start < 0:
        raise ValueError(
            f"a prefill is one row whose keys hold its queries: queries {tuple(query.shape)}, keys {tuple(key.shape)}"
        )
    own_k, own_v = key[:, :, start:], value[:, :, start:]
    if group > 1:
        own_k, own_v = own_k.repeat_interleave(group, dim=1), own_v.repeat_interleave(group, dim=1)
    out, lse = _CPU_FLASH(query, own_k, own_v, is_causal=True, scale=scale)
    if start == 0:
        return out
    folded = query.reshape(1, kv_heads, group * q, dim)  # query head h reads key head h // group
    held, held_lse = _CPU_FLASH(folded, key[:, :, :start], value[:, :, :start], scale=scale)
    held, held_lse = held.reshape(1, heads, q, dim), held_lse.reshape(1, heads, q)
    wide = torch.promote_types(query.dtype, torch.float32)  # the kernel's log-sum-exp is float32 for bf16
    lse, held_lse = lse.to(wide), held_lse.to(wide)
    merged = torch.logaddexp(lse, held_lse)
    own_w = torch.exp(lse - merged)[..., None]
    held_w = torch.exp(held_lse - merged)[..., None]
    return (out.to(wide) * own_w + held.to(wide) * held_w).to(query.dtype)


def engine_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns [1, q, H, D] like its SDPA function."""
    if attention_mask is not None:
        raise ValueError("the engine's prefill attention takes no mask: it is causal over the held tokens")
    if sliding_window is not None or kwargs.get("softcap") is not None or dropout:
        raise ValueError(
            "the engine's prefill attention supports neither sliding windows, soft-capping nor dropout"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = prefill_attention(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ENGINE_ATTENTION, engine_attention_forward)
