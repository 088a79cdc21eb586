"""The learning benchmark's statistics: the paired bootstrap and the per-problem held-out results."""

from __future__ import annotations

import pytest

from bench.learn import gave_up_by_problem, gave_up_by_step, held_out_results, paired_bootstrap
from bench.signal import _kind, mixed_fraction
from environments.problems import generate
from trajectory_store.recorder import Recorder
from trajectory_store.storage import Store


def test_paired_bootstrap_brackets_the_mean_and_is_seeded():
    assert paired_bootstrap([1.0] * 10) == (1.0, 1.0)
    assert paired_bootstrap([]) == (0.0, 0.0)
    differences = [1.0] * 6 + [0.0] * 12 + [-1.0] * 2  # mean 0.2
    low, high = paired_bootstrap(differences)
    assert low < 0.2 < high and low > -0.2 and high < 0.6
    assert paired_bootstrap(differences) == (low, high)  # the same resamples every time
    symmetric = [1.0, -1.0] * 10
    low, high = paired_bootstrap(symmetric)
    assert low < 0 < high


def test_held_out_results_average_the_samples_of_each_problem(store_config):
    recorder = Recorder(Store(store_config), step=2)
    for i, (problem, reward) in enumerate([("p", 1.0), ("p", 0.5), ("q", 1.0), ("q", 1.0)]):
        recorder.record_execution(f"e{i}", "completed", reward=reward, problem_id=problem)
    recorder.flush()
    results = held_out_results(store_config, 2)
    assert results["p"] == pytest.approx((0.5, 0.75)) and results["q"] == (1.0, 1.0)
    assert held_out_results(store_config, 3) == {}


def test_gave_up_counts_executions_ending_after_one_call_without_passing(store_config):
    """One call and no pass: a finish before any work. One call that passed, or several that failed,
    are not giving up."""
    for step, rows in [(0, [(1, 0.0), (1, 0.0), (3, 0.0), (1, 1.0)]), (4, [(2, 1.0), (5, 0.0)])]:
        recorder = Recorder(Store(store_config), step=step)
        for i, (calls, reward) in enumerate(rows):
            recorder.record_execution(
                f"s{step}e{i}", "completed", reward=reward, n_calls=calls, problem_id="p"
            )
        recorder.flush()
    assert gave_up_by_step(store_config) == {0: 0.5, 4: 0.0}
    assert gave_up_by_problem(store_config, 0) == {"p": 0.5} and gave_up_by_problem(store_config, 1) == {}


def test_mixed_fraction_counts_groups_whose_first_k_rewards_differ():
    rewards = {"a": [1.0, 1.0, 0.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0], "c": [0.0, 1.0], "d": [1.0]}
    assert mixed_fraction(rewards, 2) == (1, 1 / 3)  # a's first two agree, c's differ, d too short
    assert mixed_fraction(rewards, 4) == (1, 1 / 2)  # only a and b have four members
    assert mixed_fraction({}, 2) == (0, 0.0)


def test_a_problem_kind_names_its_suite_and_a_terminal_problem_its_operations():
    terminal = generate("terminal", 3, seed=20000, difficulty=2, length=1)
    for problem in terminal:
        operations = problem.meta["operations"]
        assert len(operations) == 2 and _kind(problem) == "terminal:" + "+".join(operations)
    assert {_kind(p) for p in generate("swe", 2, seed=20000, difficulty=1, length=1)} == {"swe"}


def test_transfer_scores_reference_solutions_and_pairs_them_by_problem(tmp_path):
    """bench.transfer: the same policy twice changes nothing; another policy changes the
    log-likelihood of every reference solution, and the seen set is the campaign's own problems."""
    import numpy as np

    from bench.transfer import paired, problem_sets, score
    from engines.model import ModelConfig, init_model
    from engines.model.loading import load_tokenizer
    from engines.train.sft import render
    from environments.demos import demonstration
    from environments.harness import TOOLS
    from tasks.campaign import choose_problems
    from tests.campaign_fixtures import tiny_campaign, tiny_policy

    before = tiny_policy(tmp_path / "a")
    after = str(tmp_path / "b")
    init_model(ModelConfig(preset="tiny", seed=1), after)
    config = tiny_campaign("t", before, str(tmp_path / "data"), steps=2)
    sets = problem_sets(config, 1, None)
    assert [p.problem_id for p in sets["seen"]] == [
        p["problem_id"] for step in range(2) for p in choose_problems.fn(config.problems, step)
    ]
    assert len(sets["unseen"]) == 1 and sets["unseen"][0].problem_id not in {
        p.problem_id for p in sets["seen"]
    }
    tokenizer = load_tokenizer(before)
    demos = [render(tokenizer, demonstration(p), TOOLS) for p in sets["seen"]]
    first, again, other = score(before, demos), score(before, demos), score(after, demos)
    assert np.array_equal(first, again) and (first[:, 0] < 0).all() and (first[:, 1] > 0).all()
    assert (first[:, 2] <= first[:, 1]).all()  # tokens not greedy are among the targets
    assert paired(again[:, 0] - first[:, 0])["mean"] == 0.0
    assert (other[:, 0] != first[:, 0]).all() and (other[:, 1] == first[:, 1]).all()
