"""Block-sparse tree attention: each query block reads only the keys its tokens may attend to.

A packed sequence lays its trees out in preorder (trajectory_store.processor.pack): every token's
subtree is the contiguous run ``[j, j + subtree_size[j])``. Two facts follow.

- Token j is i itself or one of its ancestors exactly when ``j <= i < j + subtree_size[j]``: the
  mask of any (query, key) pair is one comparison, no [T, T] table needed.
- Every ancestor of a token of the query block ``[q0, q1)`` that lies before ``q0`` is an ancestor
  of ``q0`` (its subtree is contiguous and holds both tokens). So the block's keys are the path to
  ``q0`` (at most its depth) plus the block itself.

The plan (``build_plan``, once per packed sequence) holds each token's subtree end and depth: O(T).
The attention (``tree_attention_forward``, a torch.autograd.Function) walks the query blocks; for
each it makes the key indices and the [block, keys] mask, gathers those keys and values, and keeps
only each row's output and log-sum-exp. The backward makes every block's keys and probabilities
again (flash-attention's recomputation). So the work is about sum(depth) + T * block_size pairs
instead of T^2, the memory kept for the backward is O(T) whatever the depths (a 128K-token path in
blocks of 128 would otherwise keep 67M gathered keys per layer), independent trees in one sequence
never meet, and the result is the dense-mask attention's up to float rounding.

The function is registered in transformers' AttentionInterface as ``gyre_tree``; ``use_tree_attention``
switches a model to it for one forward, which receives the plan in place of the attention mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface

from engines.model.attention import use_attention

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
    """What the kernel needs of one packed sequence, in O(T) memory: each token's subtree end. A
    block's keys and mask are made when the kernel reaches it (``block``) and dropped after it, so a
    long path costs no [blocks x depth] table (at 128K tokens in blocks of 128 that table alone would
    hold 67M key indices and as many mask entries)."""

    length: int  # T, the packed sequence's length
    block_size: int
    ends: np.ndarray  # [T] int64: one past the last token of each token's subtree
    depths: np.ndarray  # [T] int64: each token's ancestors
    dtype: torch.dtype  # of the masks ``block`` makes (the queries' dtype)
    device: torch.device | str | None
    query_sizes: list[int]  # rows of each block
    key_sizes: list[int]  # keys of each block
    allowed_pairs: int  # (query, key) pairs of the ancestor mask: sum of (depth + 1)
    computed_pairs: int  # pairs the blocks compute: sum of block rows x keys

    @property
    def density(self) -> float:
        """Allowed over computed pairs: 1.0 would waste nothing; the dense mask has allowed / T^2."""
        return self.allowed_pairs / max(self.computed_pairs, 1)

    @property
    def starts(self) -> range:
        return range(0, self.length, self.block_size)

    def block_keys(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """(key indices, allowed [rows, keys] bool) of the block that starts at ``start``."""
        stop = min(start + self.block_size, self.length)
        path = np.flatnonzero(self.ends[:start] > start)  # ancestors of `start`, ascending
        keys = np.concatenate([path, np.arange(start, stop)])
        rows = np.arange(start, stop)[:, None]
        allowed = (keys[None, :] <= rows) & (rows < self.ends[keys][None, :])
        return keys, allowed

    def block(self, start: int) -> TreeBlock:
        keys, allowed = self.block_keys(start)
        bias = torch.zeros(allowed.shape, dtype=self.dtype)
        bias.masked_fill_(torch.from_numpy(~allowed), torch.finfo(self.dtype).min)
        stop = start + len(allowed)
        return TreeBlock(
            start, stop, torch.from_numpy(keys).to(self.device), bias.to(self.device)[None, None]
        )

    @property
    def blocks(self) -> list[TreeBlock]:
        """Every block with its keys and mask (O(sum of depths) memory: for tests and small sequences)."""
        return [self.block(start) for start in self.starts]


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
    """The query blocks of one packed sequence: their sizes and the work they do (keys and masks are
    made per block by the kernel)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    size = subtree_sizes(parent_index)
    n = len(size)
    depth = [0] * n
    for i, parent in enumerate(np.asarray(parent_index).tolist()):  # parents come first (checked above)
        if parent >= 0:
            depth[i] = depth[parent] + 1
    depths = np.asarray(depth, dtype=np.int64)
    starts = range(0, n, block_size)
    query_sizes = [min(start + block_size, n) - start for start in starts]
    key_sizes = [int(depths[start]) + rows for start, rows in zip(starts, query_sizes, strict=True)]
    return TreeAttentionPlan(
        length=n,
        block_size=block_size,
        ends=np.arange(n) + size,
        depths=depths,
        dtype=dtype,
        device=device,
        query_sizes=query_sizes,
        key_sizes=key_sizes,
        allowed_pairs=int(depths.sum()) + n,
        computed_pairs=sum(q * k for q, k in zip(query_sizes, key_sizes, strict=True)),
    )


KEY_TILE = 4096
"""Keys the portable path (any device but the CPU) makes scores for at once: [heads x rows,
KEY_TILE] floats, where a 128K-token path's whole row of scores would make each pass a trip to memory."""

_CPU_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _BlockAttention(torch.autograd.Function):
    """Attention over the plan's blocks that keeps O(T) for the backward: the queries, keys, values,
    output and each row's log-sum-exp. The backward makes each block's keys and mask again and
    recomputes its probabilities from the log-sum-exp (flash-attention's recomputation), so neither
    the gathered keys nor the scores of any block outlive it.

    On the CPU each block is one call of torch's fused flash-attention kernel (its forward returns
    the log-sum-exp, its backward takes it; checked equal to the plain softmax at 1e-15 in float64):
    2.5x the speed of the same steps in torch operations. Elsewhere the blocks run the portable path
    (``_tiled_forward`` / ``_tiled_backward``). Grouped-query heads are folded into the rows: query
    head h reads key head h // (H / H_kv), as transformers' repeat_kv lays them out."""

    @staticmethod
    def forward(ctx, query, key, value, plan: TreeAttentionPlan, scale: float):  # [1, H, T, D], [1, Hk, T, D]
        heads, kv_heads = query.shape[1], key.shape[1]
        group = heads // kv_heads
        fused = query.device.type == "cpu" and _CPU_FORWARD is not None
        out = torch.empty_like(query)
        # [1, H, T], at least float32 (the fused kernel's log-sum-exp is float32 for bf16 queries)
        lse = torch.empty(
            query.shape[:3], dtype=torch.promote_types(query.dtype, torch.float32), device=query.device
        )
        for start in plan.starts:
            keys, allowed = plan.block_keys(start)
            rows = len(allowed)
            q = _fold(query[:, :, start : start + rows], kv_heads, group)  # [1, Hk, g * B, D]
            if fused:
                k, v, bias = _gathered(key, value, keys, allowed, group, q.dtype)
                o, block_lse = _CPU_FORWARD(q, k, v, attn_mask=bias, scale=scale)
            else:
                o, block_lse = _tiled_forward(q, key, value, keys, allowed, group, scale)
            out[:, :, start : start + rows] = _unfold(o, heads, rows)
            lse[:, :, start : start + rows] = _unfold(block_lse[..., None].to(lse.dtype), heads, rows)[..., 0]
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale, ctx.fused = plan, scale, fused
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        heads, kv_heads = query.shape[1], key.shape[1]
        group = heads // kv_heads
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(query)
        grad_k = torch.zeros_like(key)
        grad_v = torch.zeros_like(value)
        for start in plan.starts:
            keys, allowed = plan.block_keys(start)
            rows = len(allowed)
            span = slice(start, start + rows)
            q = _fold(query[:, :, span], kv_heads, group)
            do = _fold(grad_out[:, :, span], kv_heads, group)
            o = _fold(out[:, :, span], kv_heads, group)
            block_lse = _fold(lse[:, :, span, None], kv_heads, group)[..., 0]  # [1, Hk, g * B]
            index = torch.from_numpy(keys).to(query.device)
            if ctx.fused:
                k, v, bias = _gathered(key, value, keys, allowed, group, q.dtype)
                dq, dk, dv = _CPU_BACKWARD(do, q, k, v, o, block_lse, 0.0, False, attn_mask=bias, scale=scale)
            else:
                dq, dk, dv = _tiled_backward(q, do, o, block_lse, key, value, keys, allowed, group, scale)
            grad_q[:, :, span] = _unfold(dq, heads, rows)
            grad_k.index_add_(2, index, dk)
            grad_v.index_add_(2, index, dv)
        return grad_q, grad_k, grad_v, None, None


def _gathered(key, value, keys: np.ndarray, allowed: np.ndarray, group: int, dtype):
    """The block's keys and values [1, Hk, K, D] and its additive mask for the folded rows [g * B, K]."""
    index = torch.from_numpy(keys).to(key.device)
    bias = torch.zeros((group * len(allowed), len(keys)), dtype=dtype, device=key.device)
    bias.masked_fill_(torch.from_numpy(~np.tile(allowed, (group, 1))).to(key.device), float("-inf"))
    return key.index_select(2, index), value.index_select(2, index), bias


def _tiles(
    keys: np.ndarray, allowed: np.ndarray, group: int, device
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """(columns, key indices, mask for the folded rows [g * B, tile]) of each tile of a block's keys."""
    for begin in range(0, len(keys), KEY_TILE):
        columns = slice(begin, begin + KEY_TILE)
        mask = torch.from_numpy(np.tile(allowed[:, columns], (group, 1))).to(device)
        yield columns, torch.from_numpy(keys[columns]).to(device), mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled q k^T with the disallowed pairs at -inf.  # [1, Hk, g * B, tile]"""
    return torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))


def _tiled_forward(q, key, value, keys, allowed, group, scale):
    """One block in torch operations, its keys in tiles: a first pass makes the rows' log-sum-exp,
    a second the output. (output [1, Hk, g * B, D], log-sum-exp [1, Hk, g * B])."""
    tiles = list(_tiles(keys, allowed, group, q.device))
    lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype, device=q.device)
    for _, tile, mask in tiles:
        lse = torch.logaddexp(
            lse, torch.logsumexp(_scores(q, key.index_select(2, tile), mask, scale), dim=-1)
        )
    out = torch.zeros_like(q)
    for _, tile, mask in tiles:  # every row sees itself: lse is finite
        probs = _scores(q, key.index_select(2, tile), mask, scale).sub_(lse[..., None]).exp_()
        out.add_(torch.matmul(probs, value.index_select(2, tile)))
    return out, lse


def _tiled_backward(q, do, o, lse, key, value, keys, allowed, group, scale):
    """The gradients of one block: (dq [1, Hk, g * B, D], dk and dv [1, Hk, K, D] by key)."""
    lse = lse.to(q.dtype)
    delta = (do * o).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax backward's correction
    dq = torch.zeros_like(q)
    dk = key.new_zeros((1, key.shape[1], len(keys), key.shape[3]))
    dv = torch.zeros_like(dk)
    for columns, tile, mask in _tiles(keys, allowed, group, q.device):
        k, v = key.index_select(2, tile), value.index_select(2, tile)
        probs = _scores(q, k, mask, scale).sub_(lse[..., None]).exp_()  # [1, Hk, g * B, tile]
        dv[:, :, columns] = torch.matmul(probs.transpose(-1, -2), do)
        grad_scores = torch.matmul(do, v.transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
        dq.add_(torch.matmul(grad_scores, k))
        dk[:, :, columns] = torch.matmul(grad_scores.transpose(-1, -2), q)
    return dq, dk, dv


def _fold(x: torch.Tensor, kv_heads: int, group: int) -> torch.Tensor:
    """[1, H, B, D] -> [1, Hk, g * B, D]: the query heads that share a key head, stacked as rows."""
    return x.reshape(1, kv_heads, group * x.shape[2], x.shape[3])


def _unfold(x: torch.Tensor, heads: int, rows: int) -> torch.Tensor:
    """[1, Hk, g * B, D] -> [1, H, B, D]."""
    return x.reshape(1, heads, rows, x.shape[-1])


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
    if dropout:
        raise ValueError(f"tree attention has no attention dropout (got {dropout}); train with it at 0")
    if query.shape[0] != 1 or query.shape[2] != plan.length or key.shape[2] != plan.length:
        raise ValueError(
            f"tree attention runs on one packed sequence of {plan.length} tokens, got queries "
            f"{tuple(query.shape)} and keys {tuple(key.shape)} (a cache or a batch is not supported)"
        )
    if plan.dtype != query.dtype:
        # the plan was made for other queries: refuse rather than mix dtypes silently
        raise ValueError(
            f"the plan's masks are {plan.dtype} but the queries are {query.dtype}; "
            f"build the plan with dtype={query.dtype}"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _BlockAttention.apply(query, key.contiguous(), value.contiguous(), plan, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)


def use_tree_attention(model: torch.nn.Module) -> AbstractContextManager[None]:
    """Routes the model's attention layers to ``tree_attention_forward`` for the forward in the block.

    The backward replays the recorded graph, so it may run after the block has exited."""
    return use_attention(model, TREE_ATTENTION)
