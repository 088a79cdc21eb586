"""The controller on real processes: a two-step campaign of the shipped policy under the elastic
policy with one step in flight (so each step's tail frees cells for its training and the next step
calls them back), on three cells (engines behind the gateway, replica processes, the core as a --serve process).

Every execution finishes and is recorded, both steps publish a version, cells move to training and
back while executions run (no switch fails), the core cell never leaves training once there, and no
call trained in step s was sampled by a policy older than s - 1 (the staleness bound)."""

from __future__ import annotations

import pytest

from bench.schedule_real import RealBench, RealWork, cpu_busy
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig

pytestmark = pytest.mark.slow


def test_elastic_runs_two_steps_on_real_cells(tmp_path):
    work = RealWork(steps=2, problems_per_step=3, group_size=2, seed=7100)
    lag = 0
    params = {"depth": 1, "max_policy_lag": lag, "min_dwell_s": 1.0, "gain_factor": 0.0}
    with RealBench(str(tmp_path), cells=3) as bench:
        figures = bench.run("elastic", "elastic", params, work, held_out=3)

    assert figures["errors"] == []
    assert figures["executions"] == 12
    assert 0 < figures["cpu_busy"] <= 1  # the cells kept the cores busy some of the time, never more
    assert [s["version"] for s in figures["steps"]] == [1, 2]
    assert figures["switch_to_train_s"], "no cell moved to training"
    assert figures["switch_to_rollout_s"], "no cell came back to rollout"
    assert set(figures["switch_phases"]) >= {"train.drain", "train.sleep", "rollout.wake", "rollout.register"}

    core = [role for _, cell, role in figures["timeline"] if cell == "cell-0"]
    assert "train" in core and "rollout" not in core[core.index("train") :]

    measured = figures["measured"]
    assert [len(step) for step in measured.executions] == [6, 6]
    assert all(e.calls >= 1 and e.wall_s > e.call_s > 0 for step in measured.executions for e in step)

    con = connect(Store(StoreConfig(data_root=bench.store.data_root, campaign="schedule-elastic")))
    statuses = dict(con.execute("SELECT status, count(*) FROM executions GROUP BY ALL").fetchall())
    oldest = dict(con.execute("SELECT step, min(policy_version) FROM calls GROUP BY step").fetchall())
    con.close()
    assert sum(statuses.values()) == 12 and set(statuses) <= {"completed", "timeout"}
    assert all(version >= step - lag for step, version in oldest.items()), oldest

    # the last version, evaluated greedily on held-out problems after the makespan
    assert figures["held_out_problems"] == 3 and 0 <= figures["held_out_pass_rate"] <= 1
    con = connect(Store(StoreConfig(data_root=bench.store.data_root, campaign="schedule-elastic-eval")))
    versions = con.execute("SELECT DISTINCT policy_version FROM calls").fetchall()
    held_out = con.execute("SELECT count(*) FROM executions WHERE step = 2").fetchone()[0]
    con.close()
    assert versions == [(2,)] and held_out == 3


def test_cpu_busy_is_the_busy_share_of_the_cores_time():
    assert cpu_busy((100, 400), (160, 500)) == 0.6
    assert cpu_busy(None, (1, 2)) is None
    assert cpu_busy((5, 10), (5, 10)) is None  # no time passed: no figure rather than a division by zero
