"""sim/calibrate.py: measured executions become the simulator's workload, the fitted machine
reproduces the run it was fitted on, and its prediction moves the right way with the work."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from scheduler.policy import make_policy
from sim.calibrate import (
    SEGMENTS,
    Execution,
    MeasuredRun,
    calibrate,
    fit_training,
    load_measured,
    measured_suite,
    measured_workload,
    predict,
    save_measured,
)


def _run(seed: int, makespan_s: float, steps: int = 2, per_step: int = 8) -> MeasuredRun:
    rng = random.Random(seed)
    executions = []
    for _ in range(steps):
        row = []
        for _ in range(per_step):
            calls = rng.choice([3, 3, 3, 12])
            outputs = [rng.randint(20, 90) for _ in range(calls)]
            call_s = sum(outputs) * 0.02
            row.append(
                Execution(calls, outputs, [100 + 60 * i for i in range(calls)], call_s, call_s + 1.5, 50.0)
            )
        executions.append(row)
    return MeasuredRun("colocate", 2, executions, makespan_s, [6.0] * steps, 0.1, 0.1)


def test_measured_workload_keeps_every_token_and_second():
    run = _run(1, 60.0)
    work = measured_workload(run)
    assert work.decode_tokens.shape == (2, 8, SEGMENTS)
    for s, row in enumerate(run.executions):
        for e, ex in enumerate(row):
            assert work.decode_tokens[s, e].sum() == sum(ex.output_tokens)
            assert work.gaps_s[s, e].sum() == pytest.approx(ex.wall_s - ex.call_s)
            assert work.train_tokens[s, e] == ex.trained_tokens


def test_calibration_reproduces_its_run_and_predicts_more_work_slower():
    run = _run(2, 80.0)
    colocate = make_policy("colocate")
    machine = calibrate(run, colocate, cells=4, sessions_per_cell=2)
    # every step trained 400 tokens in the same time: no slope to fit, the update is all of it
    assert machine.trainer.update_s == pytest.approx(6.0 - 0.2)
    assert predict(machine, run, colocate, 1) == pytest.approx(80.0, rel=0.01)
    longer = dataclasses.replace(
        run,
        executions=[
            [dataclasses.replace(e, output_tokens=[3 * t for t in e.output_tokens]) for e in row]
            for row in run.executions
        ],
    )
    assert predict(machine, longer, colocate, 1) > 80.0 * 1.2
    with pytest.raises(ValueError, match="step 1 of the colocate run has 7 executions"):
        measured_workload(dataclasses.replace(run, executions=[run.executions[0], run.executions[1][:7]]))
    assert np.isfinite(predict(machine, run, make_policy("elastic", min_dwell_s=1.0, gain_factor=0.0), 2))


def test_the_update_and_the_training_rate_are_fitted_on_the_steps():
    # seconds after the last execution = 3 s + 1 ms a token: both come back
    update_s, cost = fit_training([0, 1000, 2000, 4000], [3.0, 4.0, 5.0, 7.0])
    assert update_s == pytest.approx(3.0) and cost == pytest.approx(0.001)
    # more tokens, less time (noise): the tokens cost nothing the steps can show
    assert fit_training([0, 2000, 4000], [4.0, 3.0, 3.5]) == (pytest.approx(3.5), 0.0)
    # a line below 0 at 0 tokens: through (0, 0.1) instead, never a negative update
    update_s, cost = fit_training([1000, 2000], [0.5, 2.5])
    assert update_s == 0.1 and cost == pytest.approx((1000 * 0.4 + 2000 * 2.4) / (1000**2 + 2000**2))
    run = _run(3, 60.0)
    varied = dataclasses.replace(
        run,
        executions=[
            [dataclasses.replace(e, trained_tokens=t) for e in row]
            for row, t in zip(run.executions, [0.0, 100.0], strict=True)
        ],
        post_rollout_s=[3.2, 4.0],  # 0 and 800 trained tokens a step
    )
    machine = calibrate(varied, make_policy("colocate"), cells=4, sessions_per_cell=2)
    assert machine.trainer.update_s == pytest.approx(3.0)
    assert machine.trainer.tokens_per_s == pytest.approx(800 / 0.8 / (4 * 0.5))  # per cell, 2 cores shared


def test_saved_runs_load_as_they_were(tmp_path):
    runs = {"calibration": [_run(5, 70.0)], "elastic": [_run(6, 60.0), _run(7, 61.0)]}
    save_measured(runs, str(tmp_path / "measured.json"))
    assert load_measured(str(tmp_path / "measured.json")) == runs


def test_a_partitioned_run_calibrates_cells_that_own_their_cores():
    """Cells with a CPU quota each do not share the machine's cores: the fitted machine has no shared
    cores, still reproduces its run, and an old file (no `partitioned`) reads as shared."""
    shared_run = _run(5, 80.0)
    owned_run = dataclasses.replace(shared_run, partitioned=True)
    colocate = make_policy("colocate")
    shared = calibrate(shared_run, colocate, cells=4, sessions_per_cell=2)
    owned = calibrate(owned_run, colocate, cells=4, sessions_per_cell=2)
    assert shared.cluster.shared_cores == 2 and owned.cluster.shared_cores is None
    assert predict(owned, owned_run, colocate, 1) == pytest.approx(80.0, rel=0.01)
    # on 2 shared cores 4 busy cells run at half speed, so the same run fits a faster engine there
    assert shared.engine.latency_fixed_s < owned.engine.latency_fixed_s
    assert (
        MeasuredRun(**{**dataclasses.asdict(shared_run), "executions": shared_run.executions}).partitioned
        is False
    )


def test_a_streaming_run_gives_the_update_and_colocate_the_cost_of_its_switches():
    """With an async run on the same problems, the update is what its steps spend after their last
    execution (2 s), colocate's steps' surplus (5.8 s - 2 s) becomes its switch to train, the
    training rate is what the core measured, and the decode latency reproduces the async run: one
    colocate update is no longer charged to every streaming step."""
    colocate_run = _run(8, 80.0)
    streaming_run = dataclasses.replace(
        colocate_run, policy="async", makespan_s=60.0, post_rollout_s=[2.0, 2.0]
    )
    asynchronous = make_policy("async", train_cells=1, max_policy_lag=1)
    colocate = make_policy("colocate")
    alone = calibrate(colocate_run, colocate, cells=4, sessions_per_cell=2)
    both = calibrate(colocate_run, colocate, 4, 2, streaming=(streaming_run, asynchronous, 2))
    assert alone.trainer.update_s == pytest.approx(5.8) and alone.to_train_s == pytest.approx(0.1)
    assert both.trainer.update_s == pytest.approx(2.0)
    assert both.to_train_s == pytest.approx(0.1 + 5.8 - 2.0)
    assert both.to_rollout_s == pytest.approx(0.1)
    assert predict(both, streaming_run, asynchronous, 2) == pytest.approx(60.0, rel=0.01)
    # colocate's steps still pay their surplus, now as the switch before training: 3.8 s a step
    surplus = predict(both, colocate_run, colocate, 1) - predict(
        dataclasses.replace(both, to_train_s=0.1), colocate_run, colocate, 1
    )
    assert surplus == pytest.approx(2 * 3.8, rel=0.1)
    # where the core measured its compute, the rate is that (400 tokens a step in 4 s: 100 tokens/s),
    # the update loses the last group's second and colocate's switch its training (400 tokens on 4
    # cells sharing 2 cores: 2 s)
    measured = dataclasses.replace(streaming_run, core_compute_s=[4.0, 4.0])
    rated = calibrate(colocate_run, colocate, 4, 2, streaming=(measured, asynchronous, 2))
    assert rated.trainer.tokens_per_s == pytest.approx(100.0)
    assert rated.trainer.update_s == pytest.approx(2.0 - 1.0)
    assert rated.to_train_s == pytest.approx(6.0 - 2.0 - 1.0 - 0.1)
    assert predict(rated, measured, asynchronous, 2) == pytest.approx(60.0, rel=0.01)
    # a streaming step slower than colocate's: the switch keeps its measured cost, never less
    slow = dataclasses.replace(streaming_run, post_rollout_s=[9.0, 9.0])
    assert calibrate(colocate_run, colocate, 4, 2, streaming=(slow, asynchronous, 2)).to_train_s == 0.1


def test_the_what_if_trains_every_execution_and_slower_training_never_speeds_a_policy():
    """bench/schedule_real.py's what-if: every execution's unique tokens trained (its last context and
    completion), at each rate; a slower trainer never makes a policy faster, and the speedups are
    read against the best static split."""
    from bench.schedule_real import what_if

    colocate_run = _run(9, 80.0)
    streaming = dataclasses.replace(colocate_run, policy="async", makespan_s=60.0, post_rollout_s=[2.0, 2.0])
    asynchronous = make_policy("async", train_cells=1, max_policy_lag=1)
    machine = calibrate(colocate_run, make_policy("colocate"), 4, 2, streaming=(streaming, asynchronous, 2))
    elastic_run = dataclasses.replace(_run(10, 60.0), policy="elastic")
    rows = what_if(machine, {"elastic": [elastic_run]}, [1000.0, 100.0])
    trained = np.mean(
        [sum(e.context_tokens[-1] + e.output_tokens[-1] for e in row) for row in elastic_run.executions]
    )
    assert [r["trained_tokens_per_step"] for r in rows] == [round(trained)] * 2
    assert rows[1]["one_cell_train_s_per_step"] == pytest.approx(trained / 100.0, abs=0.05)
    fast, slow = rows[0]["makespan_s"], rows[1]["makespan_s"]
    assert set(fast) == {"colocate", "async-1", "async-2", "async-3", "elastic"}
    assert all(slow[policy] >= fast[policy] - 1e-6 for policy in fast)
    for row in rows:
        best = min(row["makespan_s"][p] for p in ("async-1", "async-2", "async-3"))
        assert row["makespan_s"][row["best_async"]] == best
        # the makespans are printed to 0.1 s, the speedup from the unrounded ones
        assert row["speedup_vs_async"] == pytest.approx(best / row["makespan_s"]["elastic"], rel=3e-3)


def test_a_suite_fitted_on_runs_has_their_turns_tokens_gaps_and_trained_share():
    """sim.calibrate.measured_suite (how cpu-small was fitted): turns 3 or 12 in a 3:1 mix give the
    geometric mean and log spread; tokens per turn, unique tokens, the tool time per turn and the
    trained share are the runs' own; and the simulator then draws the same tokens per execution."""
    run = _run(1, 60.0)
    executions = [e for row in run.executions for e in row]
    suite = measured_suite([run], "short")
    turns = np.array([e.calls for e in executions], dtype=float)
    assert suite.turns_median == pytest.approx(np.exp(np.log(turns).mean()), abs=0.01)
    assert suite.turns_sigma == pytest.approx(np.log(turns).std(), abs=1e-3)
    outputs = sum(sum(e.output_tokens) for e in executions)
    assert suite.output_tokens_per_turn == pytest.approx(outputs / turns.sum(), abs=0.05)
    unique = sum(e.context_tokens[-1] + e.output_tokens[-1] for e in executions)
    assert suite.context_tokens_per_turn + suite.output_tokens_per_turn == pytest.approx(
        unique / turns.sum(), abs=0.1
    )
    assert suite.gap_median_s == pytest.approx(np.median([1.5 / e.calls for e in executions]), abs=1e-3)
    assert suite.trained_share == pytest.approx(50.0 * len(executions) / unique, abs=1e-4)
    with pytest.raises(ValueError, match="no execution"):
        measured_suite([dataclasses.replace(run, executions=[[]])])
