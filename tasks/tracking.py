"""The Prefect task that keeps a campaign's MLflow run and TensorBoard folder in step with its store.

    track(config.tracking, store, config.model_dump(mode="json"), config.steps)

The campaign flow calls it after each committed step and each held-out evaluation (flows/campaign.py),
on both step paths. It reads what the store holds (tasks/commit.py: committed steps, recorded
evaluations) and logs what a tracker lacks (trajectory_store/tracking.py says how and under which
names), so it can run any number of times, in any process. The trackers are views: a sync that fails
(a tracking server down) is logged as a warning and the campaign goes on; the next one catches up.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.commit import committed_steps, recorded_evaluations
from tasks.report import curves_png
from trajectory_store.storage import StoreConfig
from trajectory_store.tracking import (
    EVALUATION_MARKER,
    STEP_MARKER,
    MlflowSync,
    TrackingConfig,
    TrackingTargets,
    evaluation_point,
    step_point,
    sync_mlflow,
    sync_tensorboard,
)

__all__ = ["TrackingConfig", "TrackingReport", "open_commands", "sync_campaign", "track"]


class TrackingReport(BaseModel):
    mlflow: MlflowSync | None  # None: MLflow is off
    tensorboard_dir: str | None
    tensorboard_steps: list[int]  # logged by this sync
    tensorboard_evaluations: list[int]


def sync_campaign(
    tracking: TrackingConfig, store: StoreConfig, params: dict[str, Any], steps: int
) -> TrackingReport:
    """Every committed step and recorded evaluation of the campaign ``store`` not yet in its trackers,
    logged; ``params`` (the campaign config) as MLflow parameters; the run FINISHED once all ``steps``
    are committed and the last version evaluated."""
    targets = tracking.targets(store.data_root, store.campaign)
    records = committed_steps(store)
    recorded = recorded_evaluations(store)
    evaluations = {version: stored["figures"] for version, stored in recorded.items()}
    points = [step_point(r.step, r.version, r.committed_at, r.metrics) for r in records]
    points += [evaluation_point(v, float(stored["t"]), stored["figures"]) for v, stored in recorded.items()]
    finished = steps > 0 and {r.step for r in records} >= set(range(steps)) and steps in evaluations

    mlflow = None
    if targets.mlflow_uri:
        mlflow = sync_mlflow(targets, params, points, lambda: curves_png(records, evaluations), finished)
    written = sync_tensorboard(targets.tensorboard_dir, points) if targets.tensorboard_dir else []
    return TrackingReport(
        mlflow=mlflow,
        tensorboard_dir=targets.tensorboard_dir,
        tensorboard_steps=[p.step for p in written if p.marker == STEP_MARKER],
        tensorboard_evaluations=[p.step for p in written if p.marker == EVALUATION_MARKER],
    )


@task(name="track", task_run_name="tracking of {store.campaign}", cache_policy=NO_CACHE)
def track(
    tracking: TrackingConfig, store: StoreConfig, params: dict[str, Any], steps: int
) -> TrackingReport | None:
    """sync_campaign as a task that never fails the campaign: an error is a warning (None)."""
    try:
        return sync_campaign(tracking, store, params, steps)
    except Exception:
        get_run_logger().warning(
            "campaign %s: MLflow / TensorBoard could not be synced (the next sync catches up)",
            store.campaign,
            exc_info=True,
        )
        return None


def open_commands(tracking: TrackingConfig, store: StoreConfig) -> list[str]:
    """The commands that open the campaign's MLflow run and TensorBoard folder (none for one off)."""
    targets: TrackingTargets = tracking.targets(store.data_root, store.campaign)
    return targets.open_commands()
