"""The block-sparse tree attention kernel equals the dense ancestor mask, on random preorder trees."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.train import tree_attention
from engines.train.tree import ancestor_mask, attention_bias, target_logprobs
from engines.train.tree_attention import TREE_ATTENTION, build_plan, subtree_sizes, tree_attention_forward
from tests.train_fixtures import packed_batch, tiny_model

SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def random_preorder_parents(
    seed: int, length: int, p_root: float = 0.02, p_branch: float = 0.1
) -> np.ndarray:
    """Tokens laid out depth-first: each continues the previous one, branches from one of its
    ancestors, or starts a new tree (several independent trees per sequence)."""
    rng = np.random.default_rng(seed)
    parents = np.full(length, -1, dtype=np.int32)
    path: list[int] = []  # the previous token's ancestors-or-self
    for i in range(length):
        draw = rng.random()
        if not path or draw < p_root:
            path = []
        elif draw < p_root + p_branch:
            path = path[: int(rng.integers(1, len(path) + 1))]
        parents[i] = path[-1] if path else -1
        path.append(i)
    return parents


def dense_attention(query, key, value, parents):
    bias = attention_bias(parents, dtype=query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias, enable_gqa=True)
    return out.transpose(1, 2)


@SETTINGS
@given(
    seed=st.integers(0, 10_000),
    length=st.integers(1, 300),
    block_size=st.sampled_from([1, 7, 32, 128, 1024]),
    p_root=st.sampled_from([0.0, 0.02, 0.2]),
    fused=st.booleans(),
)
def test_block_attention_equals_the_dense_mask(seed, length, block_size, p_root, fused):
    """Both paths: torch's fused CPU kernel per block, and the portable one in torch operations with
    its keys in tiles of 5 (so a block spans several tiles)."""
    parents = random_preorder_parents(seed, length, p_root=p_root)
    plan = build_plan(parents, block_size=block_size)
    dense = ancestor_mask(parents)
    # the blocks' masks are the dense mask's rows, restricted to keys that hold all its allowed pairs
    assert plan.allowed_pairs == int(dense.sum())
    for block in plan.blocks:
        rows = dense[block.start : block.stop]
        assert torch.equal(rows[:, block.keys], block.bias[0, 0] == 0)
        assert rows.sum() == (block.bias == 0).sum()
    generator = torch.Generator().manual_seed(seed)
    query, key, value = (
        torch.randn(1, heads, length, 16, generator=generator, dtype=torch.float64, requires_grad=True)
        for heads in (4, 2, 2)
    )
    plan64 = build_plan(parents, block_size=block_size, dtype=torch.float64)
    # module constants: which of the two real paths runs (nothing is stood in for)
    path = (
        contextlib.nullcontext()
        if fused
        else mock.patch.multiple(tree_attention, _CPU_FORWARD=None, KEY_TILE=5)
    )
    with path:
        blocks, _ = tree_attention_forward(torch.nn.Module(), query, key, value, plan64)
        reference = dense_attention(query, key, value, parents)
        torch.testing.assert_close(blocks, reference, atol=1e-12, rtol=1e-10)
        upstream = torch.randn(reference.shape, generator=generator, dtype=torch.float64)
        grads = torch.autograd.grad((blocks * upstream).sum(), (query, key, value))
    reference_grads = torch.autograd.grad((reference * upstream).sum(), (query, key, value))
    for got, expected in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-10)


def test_block_work_follows_the_depths_not_the_square():
    parents = random_preorder_parents(0, 2000, p_root=0.001, p_branch=0.005)
    plan = build_plan(parents, block_size=64)
    assert plan.allowed_pairs == int(ancestor_mask(parents).sum())
    assert plan.computed_pairs < 0.5 * 2000**2  # less than the causal triangle, let alone the square
    assert plan.density > 0.7


def test_the_backward_keeps_what_the_sequence_holds_not_what_the_blocks_read():
    # one path of 2000 tokens in blocks of 16: the blocks read sum(depth) ~ 125K keys per head, and
    # a kernel that kept them for the backward would hold 60x what the sequence has
    length, heads, kv_heads, dim = 2000, 4, 2, 8
    parents = np.arange(-1, length - 1)
    plan = build_plan(parents, block_size=16)
    assert sum(plan.key_sizes) > 60 * length
    query = torch.randn(1, heads, length, dim, requires_grad=True)
    key, value = (torch.randn(1, kv_heads, length, dim, requires_grad=True) for _ in range(2))
    out, _ = tree_attention_forward(torch.nn.Module(), query, key, value, plan)
    node = out.grad_fn  # the output's contiguous copy, then its transpose, then the kernel
    while not hasattr(node, "saved_tensors"):
        node = node.next_functions[0][0]
    saved = sum(t.numel() for t in node.saved_tensors)
    # queries, keys, values, output, and one log-sum-exp per query row
    assert saved == length * (heads * dim + 2 * kv_heads * dim + heads * dim + heads)


def test_layouts_the_kernel_cannot_handle_are_refused():
    with pytest.raises(ValueError, match="not in preorder"):
        subtree_sizes(np.array([-1, -1, 0]))  # token 0's subtree {0, 2} is not contiguous
    with pytest.raises(ValueError, match="come before it"):
        subtree_sizes(np.array([-1, 2, 0]))
    with pytest.raises(ValueError, match="come before it"):
        ancestor_mask(np.array([-1, 1]))
    np.testing.assert_array_equal(subtree_sizes(np.array([-1, 0, 1, 0, -1, 4])), [4, 2, 1, 1, 2, 1])


def test_the_kernel_needs_its_plan_and_the_model_gets_its_attention_back(tmp_path):
    model = tiny_model(0)
    query = key = value = torch.zeros(1, 2, 3, 8)
    with pytest.raises(TypeError, match="needs a TreeAttentionPlan"):
        tree_attention_forward(model, query, key, value, torch.zeros(1, 1, 3, 3))
    with pytest.raises(ValueError, match="sliding-window"):
        tree_attention_forward(model, query, key, value, build_plan(np.array([-1, 0, 1])), sliding_window=2)
    with pytest.raises(ValueError, match="build the plan with dtype"):  # SDPA would mix them silently
        tree_attention_forward(
            model, query, key, value, build_plan(np.array([-1, 0, 1]), dtype=torch.float64)
        )
    sequence = packed_batch(str(tmp_path), seed=5, budget=4096).sequences[0]
    with torch.no_grad():
        target_logprobs(model, sequence)
    assert model.config._attn_implementation == "sdpa"
    sequence.token_ids = sequence.token_ids[:-1]  # one token short of its parent index: the kernel refuses
    sequence.position_ids = sequence.position_ids[:-1]
    with pytest.raises(ValueError, match="one packed sequence"):
        target_logprobs(model, sequence)
    assert model.config._attn_implementation == "sdpa" != TREE_ATTENTION


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000), budget=st.sampled_from([24, 4096]), block_size=st.sampled_from([4, 16, 128])
)
def test_block_and_dense_kernels_give_the_same_logprobs_and_gradients(
    tmp_path_factory, seed, budget, block_size
):
    batch = packed_batch(str(tmp_path_factory.mktemp("d")), seed, budget=budget, n_executions=4)
    if budget == 4096:  # every execution in one sequence: several independent trees side by side
        assert np.sum(batch.sequences[0].parent_index < 0) > 1
    model = tiny_model(seed % 5).eval()
    with torch.no_grad():
        for sequence in batch.sequences:
            blocks = target_logprobs(model, sequence, block_size=block_size)
            dense = target_logprobs(model, sequence, kernel="dense")
            torch.testing.assert_close(blocks.logprobs, dense.logprobs, atol=1e-5, rtol=0)
            torch.testing.assert_close(blocks.entropy, dense.entropy, atol=1e-5, rtol=0)
    grads = []
    for kernel in ("blocks", "dense"):
        model = tiny_model(1)
        for sequence in batch.sequences:
            out = target_logprobs(model, sequence, kernel=kernel, block_size=block_size)
            (out.logprobs * torch.linspace(-1, 1, len(out.logprobs))).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).norm() / grads[1].norm() <= 1e-5


def test_an_unknown_kernel_is_refused(tmp_path):
    batch = packed_batch(str(tmp_path), seed=1)
    with pytest.raises(ValueError, match="unknown tree attention kernel"):
        target_logprobs(tiny_model(0), batch.sequences[0], kernel="flash")


@pytest.mark.parametrize("fused", [True, False])
def test_bfloat16_runs_both_paths_close_to_float32(fused):
    # the core trains in bf16 (DeepSpeed): the fused kernel's log-sum-exp stays float32 whatever
    # the queries' dtype, and the portable path takes it back
    parents = random_preorder_parents(3, 300)
    generator = torch.Generator().manual_seed(3)
    q32, k32, v32 = (torch.randn(1, h, 300, 16, generator=generator, requires_grad=True) for h in (4, 2, 2))
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q32, k32, v32))
    path = contextlib.nullcontext() if fused else mock.patch.object(tree_attention, "_CPU_FORWARD", None)
    with path:
        out, _ = tree_attention_forward(
            torch.nn.Module(), q, k, v, build_plan(parents, block_size=64, dtype=torch.bfloat16)
        )
        out.float().sum().backward()
    reference = dense_attention(q32, k32, v32, parents)
    reference.sum().backward()
    torch.testing.assert_close(out.float(), reference, atol=0.06, rtol=0)
    for low, high in ((q, q32), (k, k32), (v, v32)):
        assert low.grad.dtype == torch.bfloat16
        torch.testing.assert_close(low.grad.float(), high.grad, atol=0.12, rtol=0)
