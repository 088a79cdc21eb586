"""Every layer's config section, each from a module that loads no Prefect, torch or model code.

flows/config.py composes them into CampaignConfig. Keeping this import light is what makes a
campaign config load (and a typo in it reported) in well under a second: `gyre run --config bad.toml`
answers before anything heavy is imported (tests/test_config.py checks which modules it loads).
"""

from __future__ import annotations

from engines.train.config import TrainerConfig
from environments.dispatch_config import DispatchConfig
from scheduler.config import SchedulerConfig
from stack.cluster_config import ClusterConfig
from stack.serving import ServingConfig
from tasks.problems import EvaluationConfig, ProblemsConfig
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.storage import StoreConfig
from trajectory_store.tracking import TrackingConfig

__all__ = [
    "ClusterConfig",
    "DispatchConfig",
    "EvaluationConfig",
    "PackingConfig",
    "ProblemsConfig",
    "SchedulerConfig",
    "SelectionConfig",
    "ServingConfig",
    "StoreConfig",
    "TrackingConfig",
    "TrainerConfig",
]
