"""The model side of the engine: load an HF causal LM, run prefill and batched-decode forwards on
KVRows, swap / free / restore its weights. No scheduling and no sampling here.

Supported models: decoder-only HF causal LMs whose attention layers all are full attention and write
their KV through ``cache.update(k, v, layer_idx)`` (Llama, Qwen2, Qwen3, Mistral families). The forward
gets an explicit 4D float mask and per-row position ids, so HF's own mask and padding inference is
never involved.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch

from engines.model.attention import use_attention
from engines.model.weights import load_model
from engines.rollout.attention import ENGINE_ATTENTION, flash_prefill_available
from engines.rollout.config import EngineConfig
from engines.rollout.kv import KVRows, KVShape, decode_mask, prefill_mask

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    """Owns the model. Attributes: model, shape (KVShape of its cache), vocab_size, max_model_len."""

    def __init__(self, model_or_path: torch.nn.Module | str | os.PathLike, config: EngineConfig):
        device = resolve_device(config.device)
        if isinstance(model_or_path, (str, os.PathLike)):
            model = load_model(model_or_path, dtype=DTYPES.get(config.dtype))  # "auto": the saved dtype
        else:
            model = model_or_path
        if config.dtype != "auto":
            model = model.to(DTYPES[config.dtype])
        self.model = model.to(device).eval()
        hf = self.model.config.get_text_config(decoder=True)
        layer_types = set(getattr(hf, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(
                f"the rollout engine supports full-attention layers only; this model has {sorted(layer_types)}"
            )
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        dtype = next(self.model.parameters()).dtype
        self.shape = KVShape(
            hf.num_hidden_layers, getattr(hf, "num_key_value_heads", heads), head_dim, dtype, device
        )
        self.vocab_size = hf.vocab_size
        self.max_model_len = config.max_model_len or hf.max_position_embeddings
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        # on the CPU a prefill chunk needs no [chunk, context] mask (engines/rollout/attention.py)
        self.flash_prefill = flash_prefill_available(device) and config.flash_prefill
        self._shapes: dict[str, torch.Size] | None = None  # parameter shapes while asleep

    @property
    def device(self) -> torch.device:
        return self.shape.device

    # forwards ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, kv: KVRows, tokens: list[int], chunk: int) -> torch.Tensor:
        """Appends tokens to one-row kv; returns the logits after the last one.  # [vocab]"""
        kv.reserve(kv.lengths[0] + len(tokens))
        logits = None
        for begin in range(0, len(tokens), chunk):
            piece = tokens[begin : begin + chunk]
            start = kv.lengths[0]
            ids = torch.tensor([piece], device=self.device)
            positions = torch.arange(start, start + len(piece), device=self.device)[None]
            mask = (
                None if self.flash_prefill else prefill_mask(start, len(piece), self.shape.dtype, self.device)
            )
            with use_attention(self.model, ENGINE_ATTENTION) if self.flash_prefill else nullcontext():
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    cache=kv,
                    use_cache=True,
                    logits_to_keep=1,
                )
            kv.advance(len(piece))
            logits = out.logits[0, -1]
        return logits

    @torch.inference_mode()
    def decode(self, kv: KVRows, tokens: list[int]) -> torch.Tensor:
        """Feeds one token per row, all rows in one forward; returns next-token logits.  # [rows, vocab]"""
        kv.reserve(kv.span + 1)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        positions = torch.tensor(kv.lengths, device=self.device)[:, None]
        mask = decode_mask(kv.lengths, self.shape.dtype, self.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=kv, use_cache=True)
        kv.advance(1)
        return out.logits[:, -1]

    # weights ----------------------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._shapes is not None

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies a (full or tied-deduplicated) state dict into the model's parameters in place."""
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected:
            raise ValueError(f"weights not in this model: {unexpected[:5]}")
        allowed = {"lm_head.weight"} if self.tied else set()
        if set(missing) - allowed:
            raise ValueError(f"weights missing from the state dict: {sorted(set(missing) - allowed)[:5]}")

    def free_weights(self) -> None:
        """Releases every parameter's storage (the module and its buffers stay)."""
        self._shapes = {}
        for name, param in self.model.named_parameters():
            self._shapes[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        assert self._shapes is not None, "restore_weights after free_weights only"
        for name, param in self.model.named_parameters():
            param.data = torch.empty(self._shapes[name], dtype=param.dtype, device=param.device)
        self._shapes = None
        self.load_weights(state_dict)
