"""Tree-packed forward: every token of a packed sequence attends only to itself and its ancestors.

A packed sequence (trajectory_store.processor.PackedSequence) holds several prefix-shared trees;
``parent_index`` links each token to the previous token on its path and ``position_ids`` are
depths. One forward over the packed tokens gives, for every target token t, the logits at its
parent's position, hence log p(token_t | its whole path): the same number per-path evaluation
gives, at the cost of the unique tokens only.

Two attention kernels, chosen per call (``kernel=``):

- ``"blocks"`` (the default, engines/train/tree_attention.py): block-sparse attention; each query
  block reads only the path to its first token and itself, so the work is about the sum of the
  depths instead of T^2, whatever the model was loaded with.
- ``"dense"``: a [1, 1, T, T] float mask (0 where attention is allowed, the dtype's minimum
  elsewhere) through the model's own attention, which transformers' SDPA and eager paths both
  honour. Two setups are silently wrong and refused here: a boolean 4D mask under eager attention,
  and kernels that ignore arbitrary masks (flash-attention). It is the reference the block kernel
  is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from engines.train.tree_attention import DEFAULT_BLOCK_SIZE, build_plan, use_tree_attention
from trajectory_store.processor import PackedSequence

MASK_HONOURING = ("sdpa", "eager")
Kernel = Literal["blocks", "dense"]


def ancestor_mask(parent_index: np.ndarray) -> torch.Tensor:
    """[T, T] bool: (i, j) is True when j is i or an ancestor of i.

    Parents come before their children, so row i is row parent(i) plus i itself (any such order,
    preorder or not: this is the reference the block kernel's interval test is checked against)."""
    n = len(parent_index)
    mask = np.zeros((n, n), dtype=bool)
    for i, parent in enumerate(parent_index.tolist()):
        if parent >= i:
            raise ValueError(f"token {i}'s parent {parent} does not come before it")
        if parent >= 0:
            mask[i, : parent + 1] = mask[parent, : parent + 1]
        mask[i, i] = True
    return torch.from_numpy(mask)


def attention_bias(parent_index: np.ndarray, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[1, 1, T, T] float: 0 on ancestors-or-self, the dtype's minimum elsewhere."""
    allowed = ancestor_mask(parent_index).to(device)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[None, None]


def check_attention_setup(model: torch.nn.Module, mask: torch.Tensor) -> None:
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    if implementation not in MASK_HONOURING:
        raise ValueError(
            f"attention implementation {implementation!r} ignores an arbitrary 4D mask, so tree-packed "
            f"training would attend across branches; load the model with attn_implementation='sdpa'"
        )
    if mask.dtype == torch.bool and implementation == "eager":
        raise ValueError(
            "a boolean 4D mask under eager attention is silently wrong in transformers; "
            "use attention_bias() (a float mask) or attn_implementation='sdpa'"
        )


@dataclass
class TargetLogprobs:
    logprobs: torch.Tensor  # [n_targets] log p(target | path), differentiable
    entropy: torch.Tensor  # [n_targets] entropy of the predicting distribution (no grad)
    targets: torch.Tensor  # [n_targets] indices into the sequence


def target_logprobs(
    model: torch.nn.Module,
    sequence: PackedSequence,
    *,
    targets: np.ndarray | None = None,
    kernel: Kernel = "blocks",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> TargetLogprobs:
    """One tree-packed forward; logprobs of the target tokens (default: the loss mask)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if targets is None:
        targets = np.flatnonzero(sequence.loss_mask)
    parents = sequence.parent_index[targets]
    if np.any(parents < 0):
        raise ValueError("a target token has no parent in its packed sequence (a root cannot be predicted)")
    input_ids = torch.as_tensor(sequence.token_ids, dtype=torch.long, device=device)[None]
    position_ids = torch.as_tensor(sequence.position_ids, dtype=torch.long, device=device)[None]
    if kernel == "blocks":
        plan = build_plan(sequence.parent_index, block_size=block_size, dtype=dtype, device=device)
        with use_tree_attention(model):  # the prepared mask mapping reaches every layer as is
            hidden = model.base_model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask={"full_attention": plan, "sliding_attention": plan},
                tree_plan=plan,  # for models that rebuild the mask themselves (tree_attention.py)
            ).last_hidden_state
    elif kernel == "dense":
        mask = attention_bias(sequence.parent_index, dtype=dtype, device=device)
        check_attention_setup(model, mask)
        hidden = model.base_model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask
        ).last_hidden_state
    else:
        raise ValueError(f"unknown tree attention kernel {kernel!r}; expected 'blocks' or 'dense'")
    picked = hidden[0, torch.as_tensor(parents, dtype=torch.long, device=device)]  # [n_targets, H]
    logits = model.get_output_embeddings()(picked).float()  # [n_targets, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    target_ids = torch.as_tensor(sequence.token_ids[targets], dtype=torch.long, device=device)
    chosen = log_probs.gather(1, target_ids[:, None])[:, 0]
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return TargetLogprobs(chosen, entropy, torch.as_tensor(targets, device=device))


def path_logprobs(model: torch.nn.Module, tokens: np.ndarray) -> torch.Tensor:
    """[len(tokens) - 1] log p(token_k | tokens[:k]) for k >= 1: plain per-path evaluation."""
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(tokens, dtype=torch.long, device=device)[None]
    logits = model(input_ids=input_ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, input_ids[0, 1:, None])[:, 0]
