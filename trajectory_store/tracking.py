"""Experiment tracking: a campaign's figures mirrored to MLflow and TensorBoard.

    targets = TrackingConfig().targets(data_root, campaign)
    sync_mlflow(targets, params, points, image)    # -> MlflowSync: the run, what it logged now
    sync_tensorboard(targets.tensorboard_dir, points)

The store is the campaign's record (committed steps, recorded evaluations); the trackers are views
synced from it. A caller turns every record into a ``Point`` (``step_point``, ``evaluation_point``) and
hands all of them over after each commit; a sync logs the points the tracker does not hold yet. Each
point carries a marker series (``train/version`` for a step, ``eval/version`` for an evaluation),
written in the same batch as its figures (MLflow) or in the same event record (TensorBoard), so the
steps a tracker holds are the steps of its markers: syncing twice, a retried task, or a resumed
campaign in another process logs nothing twice. The MLflow run of a campaign is found again by its
tags (``gyre.campaign``, ``gyre.data_root``), so a resumed campaign continues it.

Tracker names (the store's figure in brackets; a figure a step lacks is not logged):

    train/reward [mean_reward]  train/pass_rate [pass_rate]  train/entropy  train/grad_norm  train/loss
    train/kl  train/clip_fraction  train/executions  train/executions_trained  train/version (marker)
    tokens/trained [tokens_trained]  tokens/sent [tokens_naive]  tokens/unique [tokens_unique]
    tokens/sent_over_unique [naive_over_unique_tokens]
    time/step_s  time/rollout_s  time/train_s
    switch/count [switches]  switch/to_train_p50_s  switch/to_rollout_p50_s   (the scheduler's steps)
    eval/pass_rate  eval/reward [mean_reward]  eval/pass_rate_<suite>  eval/reward_<suite>  eval/version

A step's figures are logged at its step n (it trained policy version n into n + 1); an evaluation's
at the version it evaluated, as in the store's metrics table. Every figure stays in the store
(`gyre sql "SELECT * FROM metrics"`); these are the ones worth a chart.

mlflow and tensorboard are imported inside the functions that use them (mlflow alone costs seconds).
This module is the one place that sets MLflow's environment: telemetry off, its log quiet, and a
bounded retry on an unreachable server, so a campaign never waits minutes on a view.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

STEP_NAMES = {
    "mean_reward": "train/reward",
    "pass_rate": "train/pass_rate",
    "entropy": "train/entropy",
    "grad_norm": "train/grad_norm",
    "loss": "train/loss",
    "kl": "train/kl",
    "clip_fraction": "train/clip_fraction",
    "executions": "train/executions",
    "executions_trained": "train/executions_trained",
    "tokens_trained": "tokens/trained",
    "tokens_naive": "tokens/sent",
    "tokens_unique": "tokens/unique",
    "naive_over_unique_tokens": "tokens/sent_over_unique",
    "step_s": "time/step_s",
    "rollout_s": "time/rollout_s",
    "train_s": "time/train_s",
    "switches": "switch/count",
    "switch_to_train_p50_s": "switch/to_train_p50_s",
    "switch_to_rollout_p50_s": "switch/to_rollout_p50_s",
}
STEP_MARKER = "train/version"
EVALUATION_MARKER = "eval/version"
CURVES = "curves.png"  # the MLflow artifact: tasks/report.py's reward and pass-rate curves
# config fields never logged as parameters (credentials)
SECRET_FIELD = re.compile(r"secret|password|access_key|(^|_)token$", re.IGNORECASE)
MLFLOW_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",  # DO_NOT_TRACK=1 is not enough: MLflow only reads "true"
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # its INFO lines (database migrations) would cut `gyre run`'s progress
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",  # the default 7 retries back off for minutes
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
MAX_BATCH_METRICS = 1000  # MLflow's log_batch limits
MAX_BATCH_PARAMS = 100
MAX_PARAM_VALUE = 6000


class TrackingConfig(BaseModel):
    """Where a campaign's figures are mirrored, beside the store's metrics and the Prefect artifacts."""

    mlflow: str | None = Field(
        None,
        description="MLflow tracking URI: any MLflow server (http://host:5000), sqlite:///path.db, a path "
        "ending in .db (SQLite) or a folder; unset: sqlite:///<data_root>/tracking/mlflow.db (for an "
        "s3:// data root, ~/.gyre/tracking/<bucket-prefix>/mlflow.db); '': no MLflow",
    )
    tensorboard: str | None = Field(
        None,
        description="folder of TensorBoard event files, a subfolder per campaign; unset: "
        "<data_root>/tracking/tensorboard (~/.gyre/tracking/<bucket-prefix>/tensorboard for s3://); "
        "'': no TensorBoard",
    )
    experiment: str = Field(
        "gyrerl", description="the MLflow experiment; each campaign is a run named after it"
    )

    def targets(self, data_root: str, campaign: str) -> TrackingTargets:
        local = Path(tracking_root(data_root))
        uri = self.mlflow
        if uri is None:
            uri = f"sqlite:///{local / 'mlflow.db'}"
        elif uri and "://" not in uri and uri.endswith(".db"):
            uri = f"sqlite:///{Path(uri).resolve()}"
        artifacts = None
        if uri and uri.startswith("sqlite:///"):
            # MLflow would put a SQLite store's artifacts in ./mlartifacts of whatever the working folder is
            artifacts = str(Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts")
        board = self.tensorboard
        if board is None:
            board = str(local / "tensorboard")
        elif board and "://" not in board:
            board = str(Path(board).resolve())
        return TrackingTargets(
            campaign=campaign,
            data_root=data_root_tag(data_root),
            experiment=self.experiment,
            mlflow_uri=uri or None,
            artifact_location=artifacts,
            tensorboard_root=board or None,
        )


class TrackingTargets(BaseModel):
    """TrackingConfig resolved for one campaign: None where a tracker is off."""

    campaign: str
    data_root: str  # tagged on the MLflow run (two data roots may hold a campaign of the same name)
    experiment: str
    mlflow_uri: str | None
    artifact_location: str | None  # of the experiment, when this sync creates it on a local SQLite store
    tensorboard_root: str | None  # `tensorboard --logdir` this: each campaign is a run

    @property
    def tensorboard_dir(self) -> str | None:
        return f"{self.tensorboard_root.rstrip('/')}/{self.campaign}" if self.tensorboard_root else None

    def open_commands(self) -> list[str]:
        """What opens each tracker (`gyre run` prints them)."""
        lines = []
        uri = self.mlflow_uri
        if uri and uri.startswith(("http://", "https://")):
            lines.append(f"MLflow: {uri} (experiment {self.experiment}, run {self.campaign})")
        elif uri:
            lines.append(
                f"MLflow: MLFLOW_DISABLE_TELEMETRY=true {_program('mlflow')} ui --backend-store-uri {uri} "
                "--port 5000  "
                f"then http://127.0.0.1:5000 (experiment {self.experiment}, run {self.campaign})"
            )
        if self.tensorboard_root:
            lines.append(
                f"TensorBoard: {_program('tensorboard')} --logdir {self.tensorboard_root} --port 6006  "
                f"then http://127.0.0.1:6006 (run {self.campaign})"
            )
        return lines


def _program(name: str) -> str:
    """``name`` as a command that runs: the script beside this interpreter (the virtual environment's
    bin/, which need not be on PATH), relative to the working folder when it is below it."""
    script = Path(sys.executable).parent / name
    if not script.exists():
        return name
    with contextlib.suppress(ValueError):
        return str(script.relative_to(Path.cwd()))
    return str(script)


def tracking_root(data_root: str) -> str:
    """The local folder of the trackers' files: ``<data_root>/tracking`` for a local data root. MLflow's
    SQLite database and TensorBoard's event files want a local disk, so for object storage it is
    ``~/.gyre/tracking/<bucket-prefix>`` (as the Prefect database's ~/.gyre/prefect)."""
    if "://" in data_root and not data_root.startswith("file://"):
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", data_root.split("://", 1)[1]).strip("-") or "root"
        return str(Path.home() / ".gyre" / "tracking" / slug)
    return str(Path(data_root.removeprefix("file://")).resolve() / "tracking")


def data_root_tag(data_root: str) -> str:
    if "://" in data_root and not data_root.startswith("file://"):
        return data_root.rstrip("/")
    return str(Path(data_root.removeprefix("file://")).resolve())


# -- points ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """The figures of one record at one step, under tracker names; ``marker`` is one of them."""

    step: int
    t: float  # wall seconds
    values: dict[str, float]
    marker: str

    def ordered(self) -> list[tuple[str, float]]:
        """The figures by name, the marker last."""
        rest = sorted((k, v) for k, v in self.values.items() if k != self.marker)
        return [*rest, (self.marker, self.values[self.marker])]


def step_point(step: int, version: int, t: float, metrics: dict[str, float]) -> Point:
    values = {name: float(metrics[key]) for key, name in STEP_NAMES.items() if key in metrics}
    values[STEP_MARKER] = float(version)
    return Point(step, t, values, STEP_MARKER)


def evaluation_point(version: int, t: float, figures: dict[str, float]) -> Point:
    values = {}
    for key, value in figures.items():
        if key == "pass_rate" or key.startswith("pass_rate_"):
            values[f"eval/{key}"] = float(value)
        elif key == "mean_reward" or key.startswith("mean_reward_"):
            values[f"eval/{key.removeprefix('mean_')}"] = float(value)
    values[EVALUATION_MARKER] = float(version)
    return Point(version, t, values, EVALUATION_MARKER)


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow parameters: dotted keys, JSON values (strings as they are); credentials
    left out."""
    params: dict[str, str] = {}
    for key, value in config.items():
        if SECRET_FIELD.search(key):
            continue
        if isinstance(value, dict):
            params.update(flat_params(value, f"{prefix}{key}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[f"{prefix}{key}"] = text[:MAX_PARAM_VALUE]
    return params


def _new(points: Iterable[Point], held: dict[str, set[int]]) -> list[Point]:
    return [p for p in points if p.step not in held.get(p.marker, set())]


# -- MLflow ------------------------------------------------------------------------------------


class MlflowSync(BaseModel):
    run_id: str
    experiment_id: str
    steps: list[int]  # logged by this sync
    evaluations: list[int]


def mlflow_client(uri: str):
    for name, value in MLFLOW_ENV.items():
        os.environ.setdefault(name, value)
    from mlflow import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def find_run(client, targets: TrackingTargets, create: bool = False) -> tuple[str, str] | None:
    """(experiment id, run id) of the campaign's run; with ``create``, made if missing."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(targets.experiment)
    if experiment is None:
        if not create:
            return None
        with contextlib.suppress(MlflowException):  # made meanwhile by another process
            client.create_experiment(
                targets.experiment,
                artifact_location=targets.artifact_location,
                tags={"mlflow.experimentKind": "custom_model_development"},  # the UI's model-training view
            )
        experiment = client.get_experiment_by_name(targets.experiment)
    elif experiment.lifecycle_stage == "deleted" and create:
        client.restore_experiment(experiment.experiment_id)
    quote = '"' if "'" in targets.campaign else "'"
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`gyre.campaign` = {quote}{targets.campaign}{quote}",
        order_by=["attributes.start_time ASC"],
    )
    for run in runs:
        if run.data.tags.get("gyre.data_root") == targets.data_root:
            return experiment.experiment_id, run.info.run_id
    if not create:
        return None
    run = client.create_run(
        experiment.experiment_id,
        run_name=targets.campaign,
        tags={
            "gyre.campaign": targets.campaign,
            "gyre.data_root": targets.data_root,
            "mlflow.note.content": f"gyrerl campaign {targets.campaign}; its store: {targets.data_root}",
        },
    )
    return experiment.experiment_id, run.info.run_id


def logged_steps(client, run_id: str, markers: Iterable[str]) -> dict[str, set[int]]:
    return {m: {metric.step for metric in client.get_metric_history(run_id, m)} for m in markers}


def sync_mlflow(
    targets: TrackingTargets,
    params: dict[str, Any],
    points: list[Point],
    image: Callable[[], bytes] | None = None,
    finished: bool = False,
) -> MlflowSync:
    """Logs the points the campaign's run lacks (and the config as parameters, the curves image when
    anything was new or it is missing); the run ends FINISHED when ``finished``, else it is RUNNING."""
    if not targets.mlflow_uri:
        raise ValueError("MLflow is off for this campaign ([tracking] mlflow = '')")
    client = mlflow_client(targets.mlflow_uri)  # first: it sets MLflow's environment, then imports it
    from mlflow.entities import Metric, Param, RunTag

    experiment_id, run_id = find_run(client, targets, create=True)
    run = client.get_run(run_id)

    wanted = flat_params(params)
    missing = [Param(k, v) for k, v in sorted(wanted.items()) if k not in run.data.params]
    changed = {k: v for k, v in wanted.items() if k in run.data.params and run.data.params[k] != v}
    for i in range(0, len(missing), MAX_BATCH_PARAMS):
        client.log_batch(run_id, params=missing[i : i + MAX_BATCH_PARAMS])
    if changed:  # parameters are immutable: the run keeps those it began with, and says what differs
        text = "; ".join(f"{k}: {run.data.params[k]} -> {v}" for k, v in sorted(changed.items()))
        client.log_batch(run_id, tags=[RunTag("gyre.params_changed_on_resume", text[:MAX_PARAM_VALUE])])

    new = _new(points, logged_steps(client, run_id, {p.marker for p in points}))
    batch: list[Metric] = []
    for point in new:  # a point is never split over two batches: its marker lands with its figures
        metrics = [Metric(k, v, int(point.t * 1000), point.step) for k, v in point.ordered()]
        if batch and len(batch) + len(metrics) > MAX_BATCH_METRICS:
            client.log_batch(run_id, metrics=batch)
            batch = []
        batch.extend(metrics)
    if batch:
        client.log_batch(run_id, metrics=batch)

    if (
        image is not None
        and points
        and (new or CURVES not in {a.path for a in client.list_artifacts(run_id)})
    ):
        with tempfile.TemporaryDirectory(prefix="gyre-curves-") as folder:
            path = Path(folder) / CURVES
            path.write_bytes(image())
            client.log_artifact(run_id, str(path))

    if finished:
        if run.info.status != "FINISHED" or new:
            client.set_terminated(run_id, "FINISHED")
    elif run.info.status != "RUNNING":  # resumed
        client.update_run(run_id, status="RUNNING")
    return MlflowSync(
        run_id=run_id,
        experiment_id=experiment_id,
        steps=[p.step for p in new if p.marker == STEP_MARKER],
        evaluations=[p.step for p in new if p.marker == EVALUATION_MARKER],
    )


# -- TensorBoard -------------------------------------------------------------------------------


def tensorboard_scalars(
    log_dir: str, tags: Iterable[str] | None = None
) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar series of a run folder (of ``tags`` only, when given), read back
    with TensorBoard's own reader, in the order written."""
    if not os.path.isdir(log_dir):
        return {}
    from tensorboard.backend.event_processing import event_accumulator

    reader = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.SCALARS: 0})
    reader.Reload()
    names = reader.Tags()[event_accumulator.SCALARS]
    return {
        tag: [(event.step, event.value) for event in reader.Scalars(tag)]
        for tag in names
        if tags is None or tag in tags
    }


def sync_tensorboard(log_dir: str, points: list[Point]) -> list[Point]:
    """Appends the points the run folder lacks, each as one event record (a record is written whole or
    ignored by readers, so a crash never leaves half a point). Returns the points written; writes no
    file when there are none. (The curves image is MLflow's: TensorBoard draws these series itself.)"""
    markers = {p.marker for p in points}
    held = {
        tag: {step for step, _ in series} for tag, series in tensorboard_scalars(log_dir, markers).items()
    }
    new = _new(points, held)
    if not new:
        return []
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(log_dir)
    try:
        for point in new:
            values = [Summary.Value(tag=k, simple_value=v) for k, v in point.ordered()]
            writer.add_event(Event(wall_time=point.t, step=point.step, summary=Summary(value=values)))
    finally:
        writer.close()
    return new
