"""SchedulerConfig: who decides the cells' roles during a campaign (the ``[scheduler]`` section).

Apart from scheduler/service.py (which imports the trainer's messages and the cells), so a campaign
config is read without them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class SchedulerConfig(BaseModel):
    """Who decides the cells' roles during a campaign (the [scheduler] section of a campaign config)."""

    policy: Literal["colocate", "async", "elastic"] | None = Field(
        None,
        description="None: the campaign's step flows (one rl_step subflow per step, the pool rolls out "
        "then trains); a policy: the scheduler service runs the steps on cells (an engine and a trainer "
        "replica each, cell 0 the core) under scheduler/policy.py's policy of that name",
    )
    params: dict[str, float] = Field(
        default_factory=dict,
        description="the policy's settings (e.g. depth, max_policy_lag, min_dwell_s for elastic; "
        "train_cells for async); max_policy_lag defaults to the campaign's",
    )
    sessions_per_cell: int = Field(2, ge=1, description="executions one engine hosts at once")
    heartbeat_timeout_s: float = Field(
        120.0, gt=0, description="a scheduler silent this long is killed and restarted from the store"
    )
    restarts: int = Field(3, ge=0, description="restarts of a scheduler that died before the task fails")
