"""MLflow and TensorBoard as views of the store: a store with committed steps and recorded evaluations
(written by the real commit and record tasks) is synced, and the values are read back with MLflow's
client and TensorBoard's own event reader; syncing again, or from a resumed campaign in a new process,
logs nothing twice and continues the same MLflow run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engines.train.run import TrainStepReport
from flows.config import CampaignConfig
from tasks.commit import StepTimes, commit_step, record_evaluation
from tasks.tracking import open_commands, sync_campaign
from trajectory_store.storage import StoreConfig
from trajectory_store.tracking import TrackingConfig, flat_params, step_point

T0 = 1_700_000_000.0


def step_metrics(step: int) -> dict[str, float]:
    """What a committed step holds (flows/campaign.py rl_step; the scheduler's adds switch latencies)."""
    return {
        "mean_reward": 0.25 * step,
        "pass_rate": 0.125 * step,
        "tokens_trained": 100.0 + step,
        "naive_over_unique_tokens": 3.5,
        "step_s": 10.0 + step,
        "switch_to_train_p50_s": 1.5 + step,
        "entropy": 2.0 - 0.25 * step,
        "grad_norm": 0.5 + step,
        "executions": 8.0,
        "groups": 2.0,  # in the store only
        "version": float(step + 1),
    }


def commit(store: StoreConfig, step: int) -> None:
    """The step committed as both step paths commit one (tasks/commit.py commit_step)."""
    figures = step_metrics(step)
    trainer = {name: figures.pop(name) for name in ("entropy", "grad_norm", "tokens_trained")}
    figures.pop("version")  # commit_step writes it from the report
    ended = T0 + 60 * step
    started = ended - figures.pop("step_s")  # and the step's seconds from its times
    report = TrainStepReport(
        step=step,
        version=step + 1,
        trained=True,
        metrics=trainer,
        checkpoint_url=f"/ckpt/step={step}",
        policy_uri=f"/policy/v{step + 1}",
        policy_path=f"/fast/policy-v{step + 1}.safetensors",
        seconds=5.0,
    )
    commit_step.fn(store, report, figures, StepTimes(started=started, rolled_out=started + 4.0, ended=ended))


def evaluate(store: StoreConfig, version: int) -> None:
    figures = {"pass_rate": 0.5 + 0.125 * version, "mean_reward": 0.625, "pass_rate_terminal": 0.25}
    record_evaluation.fn(store, version, figures | {"mean_reward_terminal": 0.5, "executions": 4.0})


def campaign_config(data_root: str, steps: int) -> CampaignConfig:
    return CampaignConfig.model_validate(
        {
            "name": "tracked",
            "steps": steps,
            "store": {"data_root": data_root, "aws_secret_access_key": "hunter2"},
            "trainer": {"lr": 5e-5},
        }
    )


def history(client, run_id: str, name: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, name)]


def scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    reader = EventAccumulator(log_dir, size_guidance={SCALARS: 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()[SCALARS]}


def test_a_sync_logs_each_step_and_evaluation_once_and_a_resumed_campaign_continues_its_run(tmp_path):
    from mlflow import MlflowClient

    data_root = str(tmp_path / "data")
    config = campaign_config(data_root, steps=3)
    store = config.store.model_copy(update={"campaign": config.name})
    evaluate(store, 0)
    commit(store, 0)
    commit(store, 1)

    first = sync_campaign(config.tracking, store, config.model_dump(mode="json"), config.steps)
    assert first.mlflow.steps == [0, 1] and first.mlflow.evaluations == [0]
    assert first.tensorboard_steps == [0, 1] and first.tensorboard_evaluations == [0]

    # the defaults: a SQLite store and event files under the data root
    db = tmp_path / "data" / "tracking" / "mlflow.db"
    assert db.exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = client.get_run(first.mlflow.run_id)
    assert run.info.run_name == "tracked" and run.info.status == "RUNNING"
    assert run.data.tags["gyre.campaign"] == "tracked"
    assert run.data.params["steps"] == "3" and run.data.params["trainer.lr"] == "5e-05"
    assert run.data.params["store.data_root"] == data_root
    assert not [k for k in run.data.params if "secret" in k or "access_key" in k]
    assert history(client, run.info.run_id, "train/reward") == [(0, 0.0), (1, 0.25)]
    assert history(client, run.info.run_id, "train/pass_rate") == [(0, 0.0), (1, 0.125)]
    assert history(client, run.info.run_id, "train/entropy") == [(0, 2.0), (1, 1.75)]
    assert history(client, run.info.run_id, "train/grad_norm") == [(0, 0.5), (1, 1.5)]
    assert history(client, run.info.run_id, "tokens/trained") == [(0, 100.0), (1, 101.0)]
    assert history(client, run.info.run_id, "tokens/sent_over_unique") == [(0, 3.5), (1, 3.5)]
    assert history(client, run.info.run_id, "time/step_s") == [(0, 10.0), (1, 11.0)]
    assert history(client, run.info.run_id, "switch/to_train_p50_s") == [(0, 1.5), (1, 2.5)]
    assert history(client, run.info.run_id, "eval/pass_rate") == [(0, 0.5)]
    assert history(client, run.info.run_id, "eval/reward") == [(0, 0.625)]
    assert history(client, run.info.run_id, "eval/pass_rate_terminal") == [(0, 0.25)]
    assert [m.timestamp for m in client.get_metric_history(run.info.run_id, "train/reward")] == [
        int(T0 * 1000),
        int((T0 + 60) * 1000),
    ]
    assert "groups" not in run.data.metrics  # the store keeps every figure; the trackers the named ones
    artifacts = Path(client.download_artifacts(run.info.run_id, "curves.png", str(tmp_path / "dl")))
    assert artifacts.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    log_dir = str(tmp_path / "data" / "tracking" / "tensorboard" / "tracked")
    board = scalars(log_dir)
    assert board["train/reward"] == [(0, 0.0), (1, 0.25)]
    assert board["train/entropy"] == [(0, 2.0), (1, 1.75)]
    assert board["switch/to_train_p50_s"] == [(0, 1.5), (1, 2.5)]
    assert board["eval/pass_rate"] == [(0, 0.5)]
    files = sorted(os.listdir(log_dir))

    # a second sync (a retried task, the next commit's sync) logs nothing
    again = sync_campaign(config.tracking, store, config.model_dump(mode="json"), config.steps)
    assert again.mlflow.run_id == run.info.run_id
    assert again.mlflow.steps == again.mlflow.evaluations == again.tensorboard_steps == []
    assert history(client, run.info.run_id, "train/reward") == [(0, 0.0), (1, 0.25)]
    assert sorted(os.listdir(log_dir)) == files  # not even an empty event file

    # the campaign resumes in another process, with one step more: the same run, the new step once
    config.steps = 4
    commit(store, 2)
    commit(store, 3)
    evaluate(store, 4)
    script = (
        "import json, sys\n"
        "from flows.config import CampaignConfig\n"
        "from tasks.tracking import sync_campaign\n"
        "config = CampaignConfig.model_validate_json(sys.argv[1])\n"
        "store = config.store.model_copy(update={'campaign': config.name})\n"
        "print(sync_campaign(config.tracking, store, config.model_dump(mode='json'), config.steps)"
        ".model_dump_json())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, config.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        check=True,
    )
    resumed = json.loads(done.stdout.strip().splitlines()[-1])
    assert resumed["mlflow"]["run_id"] == run.info.run_id
    assert resumed["mlflow"]["steps"] == [2, 3] and resumed["mlflow"]["evaluations"] == [4]
    assert resumed["tensorboard_steps"] == [2, 3] and resumed["tensorboard_evaluations"] == [4]
    assert [s for s, _ in history(client, run.info.run_id, "train/reward")] == [0, 1, 2, 3]
    assert history(client, run.info.run_id, "eval/pass_rate") == [(0, 0.5), (4, 1.0)]
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"  # every step committed and the last version evaluated
    assert run.data.params["steps"] == "3"  # parameters are immutable: what changed is a tag
    assert run.data.tags["gyre.params_changed_on_resume"] == "steps: 3 -> 4"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    board = scalars(log_dir)
    assert [s for s, _ in board["train/reward"]] == [0, 1, 2, 3]
    assert board["eval/pass_rate"] == [(0, 0.5), (4, 1.0)]


def test_defaults_an_s3_data_root_a_server_and_turning_a_tracker_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    local = TrackingConfig().targets(str(tmp_path / "data"), "demo")
    assert local.mlflow_uri == f"sqlite:///{tmp_path}/data/tracking/mlflow.db"
    assert local.artifact_location == f"{tmp_path}/data/tracking/mlartifacts"
    assert local.tensorboard_dir == f"{tmp_path}/data/tracking/tensorboard/demo"
    # object storage: MLflow's SQLite and the event files want a local disk
    remote = TrackingConfig().targets("s3://bucket/runs", "demo")
    assert remote.mlflow_uri == f"sqlite:///{tmp_path}/home/.gyre/tracking/bucket-runs/mlflow.db"
    assert remote.tensorboard_root == f"{tmp_path}/home/.gyre/tracking/bucket-runs/tensorboard"
    assert remote.data_root == "s3://bucket/runs"
    server = TrackingConfig(mlflow="http://mlflow.example:5000", tensorboard="").targets("./x", "demo")
    assert server.mlflow_uri == "http://mlflow.example:5000" and server.artifact_location is None
    assert server.tensorboard_dir is None
    assert server.open_commands() == ["MLflow: http://mlflow.example:5000 (experiment gyrerl, run demo)"]
    sqlite = TrackingConfig(mlflow=str(tmp_path / "runs.db")).targets("./x", "demo")
    assert sqlite.mlflow_uri == f"sqlite:///{tmp_path}/runs.db"

    commands = open_commands(TrackingConfig(), StoreConfig(data_root=str(tmp_path / "data"), campaign="demo"))
    # the programs as commands that run: the virtual environment's scripts, which need not be on PATH
    mlflow, tensorboard = commands[0].split()[2], commands[1].split()[1]
    assert Path(mlflow).name == "mlflow" and os.access(mlflow, os.X_OK)
    assert Path(tensorboard).name == "tensorboard" and os.access(tensorboard, os.X_OK)
    assert commands[0].startswith(
        f"MLflow: MLFLOW_DISABLE_TELEMETRY=true {mlflow} ui --backend-store-uri sqlite:///{tmp_path}/data/"
    )
    assert commands[1].startswith(
        f"TensorBoard: {tensorboard} --logdir {tmp_path}/data/tracking/tensorboard "
    )

    toml = tmp_path / "c.toml"
    toml.write_text('[tracking]\nmlflow = ""\ntensorboard = ""\n')
    off = CampaignConfig.from_toml(toml)
    store = StoreConfig(data_root=str(tmp_path / "off"), campaign="c")
    commit(store, 0)
    report = sync_campaign(off.tracking, store, off.model_dump(mode="json"), 1)
    assert report.mlflow is None and report.tensorboard_dir is None
    assert not (tmp_path / "off" / "tracking").exists()
    assert open_commands(off.tracking, store) == []


def test_a_step_logs_the_figures_it_holds_under_stable_names():
    colocate = step_point(0, 1, T0, {"mean_reward": 0.5, "loss": 0.1, "train_s": 3.0, "calls": 9.0})
    assert colocate.values == {
        "train/reward": 0.5,
        "train/loss": 0.1,
        "time/train_s": 3.0,
        "train/version": 1.0,
    }
    assert colocate.ordered()[-1] == ("train/version", 1.0)  # the marker last
    config = {
        "a": {"b": [1, 2], "aws_secret_access_key": "x", "admin_token": "y", "max_tokens": 5},
        "s": None,
    }
    assert flat_params(config) == {"a.b": "[1, 2]", "a.max_tokens": "5", "s": "null"}


@pytest.mark.slow
def test_the_campaign_flow_syncs_a_finished_campaign_and_a_failing_tracker_is_a_warning(
    prefect_harness, tmp_path
):
    """The flow's hook (flows/campaign.py): run again, a campaign whose steps are all committed starts
    no service and syncs its trackers; a tracker that cannot be written never fails the flow."""
    from mlflow import MlflowClient
    from prefect import flow

    from flows.campaign import campaign
    from tasks.tracking import track

    config = campaign_config(str(tmp_path / "data"), steps=2)
    store = config.store.model_copy(update={"campaign": config.name})
    evaluate(store, 0)
    commit(store, 0)
    commit(store, 1)
    evaluate(store, 2)
    assert campaign(config) == []
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/data/tracking/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("gyrerl").experiment_id])
    assert [s for s, _ in history(client, run.info.run_id, "train/reward")] == [0, 1]
    assert run.info.status == "FINISHED"
    assert scalars(f"{tmp_path}/data/tracking/tensorboard/tracked")["eval/pass_rate"] == [(0, 0.5), (2, 0.75)]

    (tmp_path / "a-file").write_text("")
    broken = TrackingConfig(mlflow="", tensorboard=str(tmp_path / "a-file" / "tb"))

    @flow
    def a_campaign_step() -> object:
        return track(broken, store, {}, 2)

    assert a_campaign_step() is None


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="LOUD: no chromium on PATH; install Debian's chromium (apt-get install chromium) to run the UI test",
)
def test_the_mlflow_ui_shows_the_campaign_run_and_its_charts(tmp_path):
    from bench.ui import mlflow_screenshot

    config = campaign_config(str(tmp_path / "data"), steps=2)
    store = config.store.model_copy(update={"campaign": config.name})
    evaluate(store, 0)
    commit(store, 0)
    commit(store, 1)
    synced = sync_campaign(config.tracking, store, config.model_dump(mode="json"), config.steps).mlflow
    out = tmp_path / "mlflow.png"
    uri = config.tracking.targets(store.data_root, store.campaign).mlflow_uri
    drawn, charts = mlflow_screenshot(uri, synced.experiment_id, synced.run_id, str(out))
    assert charts == 17 and drawn == charts  # 11 figures of a step, 4 of an evaluation, 2 markers
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
