"""Prefect tasks that make a campaign's record in its store: commit a step, record a held-out
evaluation, read both back, prune old checkpoints.

    commit_step(store, report, figures, StepTimes(started=t0, rolled_out=t1, ended=t2))
    committed_steps(store)          # [StepRecord, ...] by step
    committed_evaluations(store)    # version -> figures

Both ways of running steps (flows/campaign.py's rl_step and the scheduler, tasks/schedule.py) commit
through ``commit_step``: the trainer's TrainStepReport, the step's own figures and its StepTimes make
the one StepRecord recipe. A step is committed by ``steps/step=<n>.json``, written after its
checkpoint and its published policy; its metrics Parquet part is derived from that record, so
writing it again is a no-op (a retried commit keeps the first record). An evaluation is
``evaluations/version=<v>.json`` (its figures and when it was recorded), mirrored into the metrics
as ``eval_*`` rows at step v.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
from prefect import task
from pydantic import BaseModel

from engines.train.run import TrainStepReport
from stack.up import revivals
from trajectory_store.schema import METRICS_SCHEMA, SCHEMA_VERSION
from trajectory_store.storage import Store, StoreConfig


class StepRecord(BaseModel):
    """What a committed step did; ``steps/step=<n>.json`` in the campaign folder."""

    step: int
    version: int  # the policy version the step made
    checkpoint_url: str
    policy_uri: str
    metrics: dict[str, float]
    committed_at: float


class StepTimes(BaseModel):
    """When a step's phases ended, wall clock (time.time()). On the step flow the phases follow each
    other; on the scheduler the step trains while it rolls out, so its train_s is what training took
    after the last execution ended (the part streaming did not hide)."""

    started: float  # the step began (the scheduler: its first execution was dispatched)
    rolled_out: float  # its last execution ended (and, on the step flow, its batch was packed)
    ended: float  # its new version was published


def step_record_path(store: Store, step: int) -> str:
    return store.path(f"steps/step={step}.json")


def _json_files(target: Store, folder: str) -> list[str]:
    """The .json files under ``folder`` of the campaign, sorted (none: [])."""
    base = target.path(folder)
    if not target.fs.exists(base):
        return []
    return sorted(path for path in target.fs.find(base) if path.endswith(".json"))


def committed_steps(store: StoreConfig) -> list[StepRecord]:
    target = Store(store)
    records = [StepRecord.model_validate_json(target.read_bytes(p)) for p in _json_files(target, "steps")]
    return sorted(records, key=lambda r: r.step)


@task(name="last-committed-step", task_run_name="find the last committed step")
def last_committed(store: StoreConfig) -> StepRecord | None:
    records = committed_steps(store)
    return records[-1] if records else None


@task(name="commit", task_run_name="commit step {report.step}", retries=2, retry_delay_seconds=1)
def commit_step(
    store: StoreConfig, report: TrainStepReport, figures: dict[str, float], times: StepTimes
) -> StepRecord:
    """Commits the step the trainer's ``report`` made: the step's ``figures`` (its executions, batch,
    switches), what the trainer did (its metrics: tokens, updates, loss, timings), the version, each
    phase's seconds and the services of `gyre up` revived meanwhile, as one StepRecord. The record
    marks the step committed (its checkpoint and policy are written), then its metrics are written;
    a retried commit keeps the first record."""
    revived = [r for r in revivals(store.data_root) if times.started <= r["wall"] <= times.ended]
    metrics = {
        **figures,
        **report.metrics,
        "services_revived": float(len(revived)),  # processes of `gyre up` that died and were started again
        "version": float(report.version),
        "trained": float(report.trained),
        "rollout_s": times.rolled_out - times.started,
        "train_s": times.ended - times.rolled_out,
        "step_s": times.ended - times.started,
    }
    record = StepRecord(
        step=report.step,
        version=report.version,
        checkpoint_url=report.checkpoint_url,
        policy_uri=report.policy_uri,
        metrics=metrics,
        committed_at=times.ended,
    )
    target = Store(store)
    path = step_record_path(target, report.step)
    if target.exists(path):  # a retried commit: the first record stands
        record = StepRecord.model_validate_json(target.read_bytes(path))
    else:
        target.write_bytes(path, record.model_dump_json().encode())
    write_metrics(store, report.step, record.metrics, record.committed_at)
    return record


def write_metrics(
    store: StoreConfig, step: int, metrics: dict[str, float], t: float, detail: str = "step"
) -> None:
    """One metrics row per figure; deterministic content, so a rewrite is a no-op."""
    rows = [(name, float(metrics[name]), None, detail, t) for name in sorted(metrics)]
    write_metric_rows(store, step, rows, f"{detail}-{step}")


def write_metric_rows(
    store: StoreConfig, step: int, rows: list[tuple[str, float, str | None, str, float]], key: str
) -> None:
    """Rows (name, value, cell_id, detail, t) as one metrics part of ``step``, committed; ``key``
    names the part (the same key and rows rewrite nothing)."""
    if not rows:
        return
    names, values, cells, details, times = map(list, zip(*rows, strict=True))
    table = pa.table(
        {
            "step": pa.array([step] * len(rows), pa.int32()),
            "name": names,
            "value": pa.array(values, pa.float64()),
            "cell_id": pa.array(cells, pa.string()),
            "detail": details,
            "t": pa.array(times, pa.float64()),
            "schema_version": pa.array([SCHEMA_VERSION] * len(rows), pa.int16()),
        },
        schema=METRICS_SCHEMA,
    )
    target = Store(store)
    rel = target.write_part("metrics", step, table, key)
    target.commit(step, {"metrics": [rel]}, {"metrics": table.num_rows})


@task(name="record-evaluation", task_run_name="record the evaluation of version {version}")
def record_evaluation(store: StoreConfig, version: int, figures: dict[str, float]) -> None:
    """The evaluation's figures as metrics of the training campaign (step = the version evaluated)."""
    target = Store(store)
    path = target.path(f"evaluations/version={version}.json")
    if target.exists(path):
        stored = json.loads(target.read_bytes(path))
    else:
        stored = {"figures": figures, "t": time.time()}
        target.write_bytes(path, json.dumps(stored, sort_keys=True).encode())
    write_metrics(
        store, version, {f"eval_{k}": v for k, v in stored["figures"].items()}, stored["t"], "evaluation"
    )


def recorded_evaluations(store: StoreConfig) -> dict[int, dict]:
    """Version -> what was recorded of its held-out evaluation: {"figures": {...}, "t": when}."""
    target = Store(store)
    found = {}
    for path in _json_files(target, "evaluations"):
        name = path.rsplit("/", 1)[-1]
        if name.startswith("version="):
            found[int(name[len("version=") : -len(".json")])] = json.loads(target.read_bytes(path))
    return dict(sorted(found.items()))


def committed_evaluations(store: StoreConfig) -> dict[int, dict[str, float]]:
    """Version -> figures of every recorded held-out evaluation."""
    return {version: stored["figures"] for version, stored in recorded_evaluations(store).items()}


@task(name="prune-checkpoints", task_run_name="prune checkpoints before step {step}")
def prune_checkpoints(store: StoreConfig, step: int, keep: int) -> list[int]:
    """Removes the checkpoints of committed steps older than the newest ``keep`` (published policies stay)."""
    target = Store(store)
    committed = [r.step for r in committed_steps(store) if r.step <= step]
    removed = []
    for old in committed[:-keep]:
        path = target.path(f"checkpoints/step={old}")
        if target.fs.exists(path):
            target.fs.rm(path, recursive=True)
            removed.append(old)
    return removed
