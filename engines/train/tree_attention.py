"""Block-sparse tree attention: each query block reads only the keys its tokens may attend to.

A packed sequence lays its trees out in preorder (trajectory_store.processor.pack): every token's
subtree is the contiguous run ``[j, j + subtree_size[j])``. Two facts follow.

- Token j is i itself or one of its ancestors exactly when ``j <= i < j + subtree_size[j]``: the
  mask of any (query, key) pair is one comparison, no [T, T] table needed.
- Every ancestor of a token of the query block ``[q0, q1)`` that lies before ``q0`` is an ancestor
  of ``q0`` (its subtree is contiguous and holds both tokens). So the block's keys are the path to
  ``q0`` (at most its depth) plus the block itself.

The plan (``build_plan``, once per packed sequence) lists, per query block, those key indices and
the [block, keys] float mask (0 where allowed, the dtype's minimum elsewhere). The attention
function (``tree_attention_forward``) gathers the keys and values of each block and runs SDPA on
them: the work is about sum(depth) + T * block_size pairs instead of T^2, independent trees in one
sequence never meet, and the result is the dense-mask attention's up to float rounding.

The function is registered in transformers' AttentionInterface as ``gyre_tree``; ``use_tree_attention``
switches a model to it for one forward, which receives the plan in place of the attention mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface

TREE_ATTENTION = "gyre_tree"
DEFAULT_BLOCK_SIZE = 128


@dataclass(frozen=True)
class TreeBlock:
    start: int  # first query of the block
    stop: int  # one past its last query
    keys: torch.Tensor  # [K] long: the path to ``start`` (ancestors, ascending), then start..stop-1
    bias: torch.Tensor  # [1, 1, stop - start, K] float: 0 on ancestors-or-self, the dtype's minimum elsewhere


@dataclass(frozen=True)
class TreeAttentionPlan:
    length: int  # T, the packed sequence's length
    blocks: list[TreeBlock]
    gather: torch.Tensor  # [sum of K] long: every block's keys, concatenated
    query_sizes: list[int]  # rows of each block
    key_sizes: list[int]  # keys of each block
    allowed_pairs: int  # (query, key) pairs of the ancestor mask: sum of (depth + 1)
    computed_pairs: int  # pairs the blocks compute: sum of block rows x keys

    @property
    def density(self) -> float:
        """Allowed over computed pairs: 1.0 would waste nothing; the dense mask has allowed / T^2."""
        return self.allowed_pairs / max(self.computed_pairs, 1)


def subtree_sizes(parent_index: np.ndarray) -> np.ndarray:
    """[T] int64: tokens in each token's subtree (itself included); refuses a layout not in preorder."""
    parents = np.asarray(parent_index, dtype=np.int64)
    index = np.arange(len(parents))
    if np.any(parents >= index) or np.any(parents < -1):
        raise ValueError(
            "every token's parent must come before it in the packed sequence (or be -1 at a root)"
        )
    sizes = [1] * len(parents)
    parent_list = parents.tolist()
    for i in range(len(parents) - 1, 0, -1):  # children after parents: one reverse sweep sums subtrees
        if parent_list[i] >= 0:
            sizes[parent_list[i]] += sizes[i]
    size = np.asarray(sizes, dtype=np.int64)
    child = index[parents >= 0]
    parent = parents[child]
    # each subtree's run inside its parent's run, by induction: every run holds exactly its subtree
    if np.any(child + size[child] > parent + size[parent]):
        raise ValueError(
            "the packed sequence is not in preorder (a subtree is not contiguous), which tree attention "
            "relies on; pack with trajectory_store.processor.pack, or use the dense kernel"
        )
    return size


def build_plan(
    parent_index: np.ndarray,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> TreeAttentionPlan:
    """The query blocks of one packed sequence, their key indices and masks."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    size = subtree_sizes(parent_index)
    n = len(size)
    ends = np.arange(n) + size  # [T] one past the last token of each subtree
    lowest = torch.finfo(dtype).min
    blocks = []
    allowed_pairs = computed_pairs = 0
    for start in range(0, n, block_size):
        stop = min(start + block_size, n)
        path = np.flatnonzero(ends[:start] > start)  # ancestors of `start`, ascending
        keys = np.concatenate([path, np.arange(start, stop)])
        rows = np.arange(start, stop)[:, None]
        allowed = (keys[None, :] <= rows) & (rows < ends[keys][None, :])  # [B, K]
        bias = torch.zeros(allowed.shape, dtype=dtype)
        bias.masked_fill_(torch.from_numpy(~allowed), lowest)
        blocks.append(TreeBlock(start, stop, torch.from_numpy(keys).to(device), bias.to(device)[None, None]))
        allowed_pairs += int(allowed.sum())
        computed_pairs += allowed.size
    gather = torch.cat([block.keys for block in blocks]) if blocks else torch.zeros(0, dtype=torch.long)
    return TreeAttentionPlan(
        length=n,
        blocks=blocks,
        gather=gather.to(device),  # [sum of K]
        query_sizes=[block.stop - block.start for block in blocks],
        key_sizes=[len(block.keys) for block in blocks],
        allowed_pairs=allowed_pairs,
        computed_pairs=computed_pairs,
    )


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, H_kv, T, D]
    value: torch.Tensor,  # [1, H_kv, T, D]
    attention_mask: TreeAttentionPlan,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns [1, T, H, D] like its SDPA function.

    The plan arrives as the mask where the model passes a prepared mask mapping through (Qwen2, Qwen3),
    else as the ``tree_plan`` keyword that every layer forwards (Llama and Mistral build their own
    mask, which a custom attention function gets as None)."""
    plan = attention_mask if isinstance(attention_mask, TreeAttentionPlan) else kwargs.get("tree_plan")
    if not isinstance(plan, TreeAttentionPlan):
        raise TypeError(
            f"{TREE_ATTENTION!r} attention needs a TreeAttentionPlan as its mask, got "
            f"{type(plan).__name__}; call the model through engines.train.tree.target_logprobs"
        )
    if sliding_window is not None or kwargs.get("softcap") is not None:
        raise ValueError("tree attention supports neither sliding-window layers nor logit soft-capping")
    if query.shape[0] != 1 or query.shape[2] != plan.length or key.shape[2] != plan.length:
        raise ValueError(
            f"tree attention runs on one packed sequence of {plan.length} tokens, got queries "
            f"{tuple(query.shape)} and keys {tuple(key.shape)} (a cache or a batch is not supported)"
        )
    if plan.blocks and plan.blocks[0].bias.dtype != query.dtype:
        # SDPA does not refuse a mask of another float dtype, and its result is then wrong
        raise ValueError(
            f"the plan's masks are {plan.blocks[0].bias.dtype} but the queries are {query.dtype}; "
            f"build the plan with dtype={query.dtype}"
        )
    grouped = query.shape[1] != key.shape[1]
    # one gather per tensor and views per block: the backward is one scatter and one concatenation,
    # where per-block slices would each zero a gradient as large as the whole sequence
    queries = query.split(plan.query_sizes, dim=2)
    keys = key.index_select(2, plan.gather).split(plan.key_sizes, dim=2)
    values = value.index_select(2, plan.gather).split(plan.key_sizes, dim=2)
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=block.bias, dropout_p=dropout, scale=scaling, enable_gqa=grouped
        )  # [1, H, B, D]
        for q, k, v, block in zip(queries, keys, values, plan.blocks, strict=True)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)


@contextmanager
def use_tree_attention(model: torch.nn.Module) -> Iterator[None]:
    """Routes the model's attention layers to ``tree_attention_forward`` for the forward in the block.

    The backward replays the recorded graph, so it may run after the block has exited."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = TREE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
