"""Tree-packed training equals per-path training: logprobs and gradients, on random trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.train.config import LossConfig
from engines.train.loss import policy_loss
from engines.train.reference import (
    compare,
    flat_grad,
    near_policy_behaviour,
    path_indices,
    per_path_backward,
    per_path_jobs,
)
from engines.train.tree import attention_bias, check_attention_setup, path_logprobs, target_logprobs
from engines.train.worker import GradWorker
from tests.train_fixtures import packed_batch, perturb_behaviour, tiny_model

SETTINGS = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(seed=st.integers(0, 10_000), budget=st.sampled_from([24, 64, 4096]))
def test_tree_logprobs_equal_per_path_evaluation(tmp_path_factory, seed, budget):
    model = tiny_model(seed % 7).eval()
    batch = packed_batch(str(tmp_path_factory.mktemp("d")), seed, budget=budget)
    worst = 0.0
    compared = 0
    with torch.no_grad():
        for sequence in batch.sequences:
            tree = target_logprobs(model, sequence)
            for target, value in zip(tree.targets.tolist(), tree.logprobs.tolist(), strict=True):
                path = path_indices(sequence, target)
                reference = path_logprobs(model, sequence.token_ids[path])[-1].item()
                worst = max(worst, abs(value - reference))
                compared += 1
    assert compared == batch.n_target_tokens > 0
    assert worst <= 1e-5


@SETTINGS
@given(seed=st.integers(0, 10_000), budget=st.sampled_from([24, 4096]))
def test_tree_gradients_equal_per_path_training(tmp_path_factory, seed, budget):
    batch = packed_batch(str(tmp_path_factory.mktemp("d")), seed, budget=budget)
    perturb_behaviour(batch, seed)
    n_executions = len(batch.advantages)
    config = LossConfig(kl_coef=0.05)
    tree_model = tiny_model(1)
    worker = GradWorker(tree_model, config)
    for index, sequence in enumerate(batch.sequences):
        worker.accumulate(sequence, n_executions, index, version=0)

    # per-path: every trajectory on its own causal forward, each target once, with the same weights
    path_model = tiny_model(1)
    jobs = per_path_jobs(batch.sequences)
    for sequence in batch.sequences:  # every target on exactly one path
        mine = np.concatenate([job.targets for job in jobs if job.sequence is sequence])
        assert sorted(mine.tolist()) == np.flatnonzero(sequence.loss_mask).tolist()
    per_path_backward(path_model, jobs, n_executions, config)
    reference = flat_grad(path_model)
    relative = (worker.grad - reference).norm() / reference.norm()
    assert reference.norm() > 0
    assert relative <= 1e-5


def test_compare_agrees_on_a_real_batch_and_catches_wrong_depths(tmp_path):
    """The benchmarks' comparison: exact agreement on a real batch; a tree forward given wrong
    position ids (depths doubled) is reported as a miss in both logprobs and gradient."""
    batch = packed_batch(str(tmp_path), seed=5)
    model = tiny_model(3)
    near_policy_behaviour(batch.sequences, model)
    agreement = compare(model, batch.sequences, len(batch.advantages))
    assert agreement.targets == batch.n_target_tokens > 0
    assert agreement.paths >= len(batch.sequences)
    assert agreement.max_abs_logprob_diff <= 1e-5 and agreement.grad_rel_diff <= 1e-5
    assert agreement.reference_grad_norm > 0
    assert all(p.grad is None for p in model.parameters())  # nothing left behind
    behaviour = [s.behaviour_logprobs[s.loss_mask] for s in batch.sequences]
    assert all(np.all(b <= 0) for b in behaviour) and any(np.any(b < 0) for b in behaviour)

    for sequence in batch.sequences:
        sequence.position_ids = sequence.position_ids * 2
    wrong = compare(model, batch.sequences, len(batch.advantages))
    assert wrong.max_abs_logprob_diff > 1e-3 and wrong.grad_rel_diff > 1e-3


def test_policy_loss_clips_and_averages_per_execution():
    config = LossConfig(clip_low=0.2, clip_high=0.2)
    behaviour = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    current = torch.log(torch.tensor([0.8, 0.3, 0.5, 0.55])).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    weights = torch.tensor([0.5, 0.5, 0.5, 0.5])  # two executions of two tokens each
    terms = policy_loss(current, behaviour, advantages, weights, n_executions=2, config=config)
    # ratios 1.6 (clipped to 1.2 for A>0), 0.6, 1.0, 1.1
    expected = -(0.5 * 1.2 + 0.5 * 0.6 - 0.5 * 1.0 - 0.5 * 1.1) / 2
    torch.testing.assert_close(terms.loss, torch.tensor(expected))
    assert terms.clipped == 1
    assert terms.ratio_max == pytest.approx(1.6)
    terms.loss.backward()
    assert current.grad[0] == 0  # a clipped token gives no gradient


def test_attention_setups_that_are_silently_wrong_are_refused():
    model = tiny_model(0, attn="eager")
    parents = np.array([-1, 0, 1, 1])
    with pytest.raises(ValueError, match="boolean 4D mask under eager"):
        check_attention_setup(model, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    check_attention_setup(model, attention_bias(parents))  # a float mask is fine under eager
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="ignores an arbitrary 4D mask"):
        check_attention_setup(model, attention_bias(parents))


def test_eager_attention_with_a_float_mask_matches_sdpa(tmp_path):
    batch = packed_batch(str(tmp_path), seed=3)
    sdpa, eager = tiny_model(2).eval(), tiny_model(2, attn="eager").eval()
    with torch.no_grad():
        for sequence in batch.sequences:
            a = target_logprobs(sdpa, sequence).logprobs
            b = target_logprobs(eager, sequence).logprobs
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_shared_prefixes_pack_fewer_tokens_with_the_same_paths_and_gradient(tmp_path):
    """Two groups whose executions start with the same system prompt (and, within a group, the same
    instruction): sharing places the common context once per sequence, every selected path still
    rebuilds exactly, the layout stays in preorder (the block kernel checks it), and the gradient
    equals the one of the packing without sharing."""
    from tests.test_trees import record
    from trajectory_store.config import PackingConfig, SelectionConfig
    from trajectory_store.db import connect
    from trajectory_store.processor import pack, path_to

    rng = np.random.default_rng(3)
    system = rng.integers(0, 60, 40).astype(np.int32)
    executions, rewards = {}, {}
    for group in range(2):
        instruction = rng.integers(0, 60, 12).astype(np.int32)
        for member in range(3):
            execution_id = f"g{group}-m{member}"
            prompt = np.concatenate([system, instruction]).astype(np.int32)
            calls = []
            for call_id in range(2):
                output = rng.integers(0, 60, 6).astype(np.int32)
                calls.append(
                    {
                        "execution_id": execution_id,
                        "call_id": call_id,
                        "agent_id": "main",
                        "role": "main",
                        "prompt_ids": prompt,
                        "output_ids": output,
                        "output_logprobs": np.full(6, -0.7, np.float32),
                        "policy_version": 0,
                    }
                )
                prompt = np.concatenate([prompt, output, rng.integers(0, 60, 4)]).astype(np.int32)
            executions[execution_id] = calls
            rewards[execution_id] = float(member % 2)
    store = record(tmp_path, executions, rewards)
    con = connect(store, SelectionConfig(j_max=5))
    plain = pack(con, PackingConfig(token_budget=4096, share_prefixes=False))
    shared = pack(con, PackingConfig(token_budget=4096))
    # each group's later members share the whole first prompt, the second group's first member the system prompt
    assert shared.n_shared_tokens == 2 * 2 * 52 + 40
    assert shared.n_tokens == plain.n_tokens - shared.n_shared_tokens
    assert shared.n_target_tokens == plain.n_target_tokens

    def paths(batch):
        return {(e, t): path_to(s, i).tolist() for s in batch.sequences for e, t, i in s.leaves}

    assert paths(shared) == paths(plain)
    from engines.train.tree_attention import subtree_sizes

    for sequence in shared.sequences:
        subtree_sizes(sequence.parent_index)  # raises if a subtree is not contiguous

    def gradient(batch):
        worker = GradWorker(tiny_model(2), LossConfig())
        for index, sequence in enumerate(batch.sequences):
            worker.accumulate(sequence, len(batch.advantages), index, version=0)
        return worker.grad

    reference, got = gradient(plain), gradient(shared)
    assert reference.norm() > 0
    assert (got - reference).norm() / reference.norm() <= 1e-5
