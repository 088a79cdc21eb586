"""The training benchmark's measurements (bench/train.py) on the tiny preset and a small workload: the
tree-packed and per-path gradients it times agree, whatever kernel or baseline; timings are not
asserted."""

from __future__ import annotations

import pytest
import torch

from bench.train import _equality, _model_folder, _throughput, best_times, workload
from engines.model.weights import load_model
from engines.train.reference import near_policy_behaviour

SIZE = {"max_context": 300, "max_turns": 3, "budget": 512, "executions": 4}  # groups of 2: advantages


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-train")
    model_dir = str(root / "policy")
    vocab = _model_folder("tiny", model_dir)
    batch, naive = workload(str(root / "data"), min(vocab, 4096), SIZE)
    near_policy_behaviour(batch.sequences, load_model(model_dir, dtype="float32"))
    return model_dir, batch, naive


def test_equality_and_throughput_figures_agree_within_fp32(tiny_run):
    model_dir, batch, naive = tiny_run
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        equality = _equality(model_dir, batch)
        figures = _throughput(model_dir, batch, repeats=1, extra_repeats=1)
    finally:
        torch.set_num_threads(saved)
    assert equality["tree_vs_path_max_abs_logprob_diff"] <= 1e-5
    assert equality["tree_vs_path_grad_rel_diff"] <= 1e-5  # of a gradient that is not zero
    assert figures["tree_vs_path_grad_rel_diff_at_speed"] <= 1e-5
    assert figures["dense_vs_tree_grad_rel_diff"] <= 1e-5
    assert figures["lean_path_vs_tree_grad_rel_diff"] <= 1e-5
    assert figures["target_tokens"] == batch.n_target_tokens > 0
    assert figures["per_path_tokens"] >= naive > 0  # every selected trajectory, whole (split trees add more)
    assert figures["naive_over_unique_tokens"] >= 1


def test_best_times_interleaves_and_caps_rounds():
    calls: list[str] = []
    ticks = iter(range(100))
    best, results = best_times(
        {"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2},
        repeats=3,
        clock=lambda: float(next(ticks)),
        at_most={"b": 1},
    )
    assert calls == ["a", "b", "a", "a"]
    assert best == {"a": 1.0, "b": 1.0} and results == {"a": 1, "b": 2}
