"""A campaign small enough for a test: a tiny random policy, one problem per step, two executions
of one short turn each, one held-out problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_policy(folder: Path) -> str:
    from engines.model import ModelConfig, init_model

    init_model(ModelConfig(preset="tiny", seed=0), str(folder))
    return str(folder)


def tiny_campaign(name: str, policy: str, data_root: str, **overrides: Any):
    from flows.config import CampaignConfig

    config = CampaignConfig.model_validate(
        {
            "name": name,
            "policy": policy,
            "steps": 1,
            "store": {"data_root": data_root},
            "problems": {"suites": ["terminal"], "per_step": 1},
            "evaluation": {"per_suite": 1},
            "dispatch": {
                "group_size": 2,
                "timeout_s": 60,
                "durations": {"short_turns": 1, "long_fraction": 0.0},
                "harness": {"max_tokens": 16, "max_retries": 0, "max_subagents": 0},
            },
            "serving": {"trainer_threads": 1},
        }
    )
    return config.merged(overrides)


def tracked_steps(tracking: Path, campaign: str, names: list[str]) -> dict[str, tuple[list, list]]:
    """Name -> (the steps MLflow's client reads back, the steps TensorBoard's event reader reads back)
    for a campaign tracked under ``tracking`` (the default: <data_root>/tracking); the MLflow run is
    the campaign's only one, FINISHED, with the curves image."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    client = MlflowClient(f"sqlite:///{tracking / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("gyrerl")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.`gyre.campaign` = '{campaign}'")
    assert run.info.status == "FINISHED"
    assert "curves.png" in [a.path for a in client.list_artifacts(run.info.run_id)]
    events = EventAccumulator(str(tracking / "tensorboard" / campaign))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    return {
        name: (
            [m.step for m in client.get_metric_history(run.info.run_id, name)],
            [e.step for e in events.Scalars(name)] if name in scalars else [],
        )
        for name in names
    }
