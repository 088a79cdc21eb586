"""tasks/report.py's held-out figures: the paired bootstrap, the per-problem held-out results, the
give-up rate, and the paired gain `gyre run` prints (the store is an argument: no flow imported)."""

from __future__ import annotations

import pytest

from tasks.report import (
    gave_up_by_problem,
    gave_up_by_step,
    held_out_gain,
    held_out_results,
    paired_bootstrap,
)
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


def test_held_out_gain_pairs_two_versions_by_problem(store_config):
    """p passes after (it gave up before), q passes both times, r fails after (giving up); s only
    before (unpaired)."""
    for version, rows in [
        (0, [("p", 0.0, 1), ("q", 1.0, 3), ("r", 1.0, 2), ("s", 1.0, 2)]),
        (3, [("p", 1.0, 4), ("q", 1.0, 2), ("r", 0.5, 1)]),
    ]:
        recorder = Recorder(Store(store_config), step=version)
        for i, (problem, reward, calls) in enumerate(rows):
            recorder.record_execution(
                f"v{version}e{i}", "completed", reward=reward, n_calls=calls, problem_id=problem
            )
        recorder.flush()
    gain = held_out_gain(store_config, 0, 3)
    assert gain["held_out_problems"] == 3
    assert (gain["pass_rate_before"], gain["pass_rate_after"]) == (round(2 / 3, 4), round(2 / 3, 4))
    assert (gain["mean_reward_before"], gain["mean_reward_after"]) == (round(2 / 3, 4), round(2.5 / 3, 4))
    assert (gain["pass_rate_gain"], gain["problems_gained"], gain["problems_lost"]) == (0.0, 1, 1)
    assert gain["pass_rate_gain_ci95_low"] <= 0.0 <= gain["pass_rate_gain_ci95_high"]
    assert (gain["gave_up_before"], gain["gave_up_after"]) == (round(1 / 3, 4),) * 2  # p before, r after
    with pytest.raises(RuntimeError, match="version 0 and at version 5"):
        held_out_gain(store_config, 0, 5)
