"""The one recipe of a committed step (tasks/commit.py commit_step), which the step flow and the
scheduler both commit through: the trainer's report, the step's figures and its times make the record;
a retried commit keeps the first record; the metrics part holds the record's figures."""

from __future__ import annotations

import pytest

from engines.train.run import TrainStepReport
from scheduler.cells import Switch
from tasks.commit import StepTimes, commit_step, committed_steps
from tasks.steps import switch_figures
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig


def _report(step: int, loss: float) -> TrainStepReport:
    return TrainStepReport(
        step=step,
        version=step + 1,
        trained=True,
        metrics={"loss": loss, "tokens_trained": 40.0, "updates": 1.0},
        checkpoint_url=f"memory://c/checkpoints/step={step}",
        policy_uri=f"memory://c/policy/v{step + 1}",
        policy_path=f"/tmp/policy-v{step + 1}.safetensors",
        seconds=1.5,
    )


def test_a_step_commits_the_trainers_report_its_figures_and_its_times(tmp_path):
    store = StoreConfig(data_root=str(tmp_path / "data"), campaign="c")
    times = StepTimes(started=100.0, rolled_out=130.0, ended=142.5)
    record = commit_step.fn(store, _report(0, 0.25), {"executions": 8.0, "mean_reward": 0.5}, times)

    assert (record.step, record.version, record.committed_at) == (0, 1, 142.5)
    assert record.policy_uri == "memory://c/policy/v1"
    assert record.metrics == {
        "executions": 8.0,
        "mean_reward": 0.5,
        "loss": 0.25,
        "tokens_trained": 40.0,
        "updates": 1.0,
        "services_revived": 0.0,
        "version": 1.0,
        "trained": 1.0,
        "rollout_s": 30.0,
        "train_s": 12.5,
        "step_s": 42.5,
    }
    # a retried commit (another attempt's figures) keeps the record the first one wrote
    again = commit_step.fn(store, _report(0, 9.0), {"executions": 1.0}, times)
    assert again == record == committed_steps(store)[0]
    con = connect(Store(store))
    rows = dict(con.execute("SELECT name, value FROM metrics WHERE step = 0").fetchall())
    con.close()
    assert rows == pytest.approx(record.metrics)


def test_switch_figures_count_a_steps_switches_and_their_median_per_direction():
    switches = [
        Switch("cell-1", "train", 0.0, {"drain": 0.5, "sleep": 0.25}),
        Switch("cell-2", "train", 1.0, {"drain": 1.0, "sleep": 1.0}),
        Switch("cell-3", "train", 2.0, {"drain": 3.0}),
        Switch("cell-1", "rollout", 3.0, {"wake": 0.5}),
    ]
    assert switch_figures(switches) == {
        "switches": 4.0,
        "switch_to_train_p50_s": 2.0,
        "switch_to_rollout_p50_s": 0.5,
    }
    assert switch_figures([]) == {"switches": 0.0}
