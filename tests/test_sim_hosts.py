"""The simulator's prediction for a campaign's cells spread over hosts (sim/calibrate.py `on_hosts`,
bench/hosts.py `sim_prediction`): calibrated on a run on one host, it predicts the same executions on
three hosts of the same cores, where each host's link carries a third of the weight pulls."""

from __future__ import annotations

import dataclasses

import pytest

from bench.hosts import sim_prediction
from scheduler.policy import make_policy
from sim.calibrate import Execution, MeasuredRun, calibrate, link_pull_s, on_hosts, predict


def _run(makespan_s: float) -> MeasuredRun:
    executions = [
        [
            Execution(
                calls=4,
                output_tokens=[20 + e, 18, 22, 19],
                context_tokens=[300, 340, 380, 420],
                call_s=6.0 + e,
                wall_s=9.0 + e,
                trained_tokens=80.0 if e % 3 else 0.0,
            )
            for e in range(6)
        ]
        for _ in range(2)
    ]
    return MeasuredRun(
        policy="colocate",
        group_size=2,
        executions=executions,
        makespan_s=makespan_s,
        post_rollout_s=[7.5, 8.5],
        to_train_s=0.0,
        to_rollout_s=0.0,
        sessions_per_cell=2,
    )


def test_the_busiest_link_sets_the_weight_pull_and_the_machine_keeps_its_cells():
    assert link_pull_s(3, 1, 16e6, 8e7) == pytest.approx(0.6)  # three pulls over one link
    assert link_pull_s(3, 3, 16e6, 8e7) == pytest.approx(0.2)
    assert link_pull_s(4, 3, 16e6, 8e7) == pytest.approx(0.4)  # one host holds two cells
    run = dataclasses.replace(_run(40.0), to_rollout_s=0.6)
    machine = calibrate(run, make_policy("colocate"), 3, 2)
    spread = on_hosts(machine, 3, 1, 16e6, 8e7)
    assert spread.to_rollout_s == pytest.approx(machine.to_rollout_s - 0.4)
    assert spread.cluster == machine.cluster and spread.engine == machine.engine


def test_the_prediction_for_three_hosts_reproduces_the_calibration_and_saves_only_the_link_time():
    one = _run(40.0)
    figures = sim_prediction(one, one, {"bytes": 16e6, "other_host_s": 0.2})
    assert figures["weight_pull_s"] == {"1_host": 0.6, "3_hosts": 0.2}
    # the calibration reproduces its run; the same executions on three hosts take at most the link
    # time it saves per step less, and no more
    assert figures["step_s_1_host_fitted"] == pytest.approx(figures["step_s_1_host_measured"], rel=0.02)
    saved = figures["step_s_1_host_fitted"] - figures["step_s_3_hosts_predicted"]
    assert -0.05 <= saved <= 0.4 + 0.05
    assert figures["error"] < 0.03


def test_the_policies_rows_are_predicted_again_from_the_runs_the_benchmark_saved(tmp_path):
    """bench/hosts_schedule.py saves the runs its prediction used; `--sim FILE` predicts from them
    again, calibrated on the 1-host colocate run with the 1-host async run's training rate."""
    import json
    import subprocess
    import sys

    from bench.hosts_schedule import sim_rows
    from sim.calibrate import save_measured

    one = _run(40.0)
    streaming = dataclasses.replace(_run(34.0), policy="async", core_compute_s=[3.0, 3.0])
    rows = {"colocate": one, "async": streaming}
    direct = sim_rows(one, rows, None, streaming)
    assert direct["calibrated_on"] == "1 host, colocate and async"
    assert direct["rows"]["async"]["error"] < 0.05  # the decode latency is fitted to the streaming run
    path = tmp_path / "measured.json"
    save_measured(
        {"calibration": [one], "streaming": [streaming]} | {n: [r] for n, r in rows.items()}, str(path)
    )
    again = subprocess.run(
        [sys.executable, "-m", "bench.hosts_schedule", "--sim", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(again.stdout) == direct


def test_a_measured_batch_cost_prices_each_sequence_of_a_decode_step():
    """bench/batch_cost.py measures what a second sequence costs a cell's decode step; the calibrated
    machine prices each sequence at that share of the step's fixed cost, and the bisection fits the
    fixed cost under it (the calibration run is reproduced either way)."""
    run = _run(40.0)
    cheap = calibrate(run, make_policy("colocate"), 3, 2)
    dear = calibrate(run, make_policy("colocate"), 3, 2, batch_cost=1.0)
    assert cheap.engine.latency_per_seq_s == pytest.approx(cheap.engine.latency_fixed_s * 0.2)
    assert dear.engine.latency_per_seq_s == pytest.approx(dear.engine.latency_fixed_s)
    assert dear.engine.latency_fixed_s < cheap.engine.latency_fixed_s  # the same run, dearer batches
    for machine in (cheap, dear):
        assert predict(machine, run, make_policy("colocate"), 1) == pytest.approx(40.0, rel=0.02)


@pytest.mark.slow
def test_the_batch_cost_is_measured_in_a_cell_of_its_quota():
    from bench.batch_cost import batch_cost

    figures = batch_cost(0.5)
    assert figures["steps_timed"]["1"] >= 90 and figures["steps_timed"]["2"] >= 90, figures
    assert figures["fixed_s"] > 0 and figures["batch_cost"] >= 0, figures
    assert figures["quota"] is True, figures  # root here: the probe ran in its cgroup
