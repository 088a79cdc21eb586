"""Typed configuration of the trajectory store's processing: selection and packing.

StoreConfig (where data lives) is in storage.py; flows/config.py composes these into CampaignConfig.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from trajectory_store.schema import ROLES, STATUSES


class SelectionConfig(BaseModel):
    """Which trajectories of an execution are trained on."""

    role_priority: list[str] = Field(
        default_factory=lambda: ["main", "sub", "main_summary", "sub_summary"],
        description="roles in order of priority; roles not listed are never selected",
    )
    j_max: int = Field(5, ge=1, description="at most this many trajectories per execution")
    seed: int = Field(0, description="seed of the weighted sampling within a role")
    trainable_statuses: list[str] = Field(
        default_factory=lambda: ["completed", "timeout"],
        description="executions with these statuses are trained on (eval_failed and abandoned never are)",
    )

    @field_validator("role_priority")
    @classmethod
    def _known_roles(cls, roles: list[str]) -> list[str]:
        _only(roles, ROLES, "roles")
        if len(set(roles)) != len(roles):
            raise ValueError(f"role_priority lists a role twice: {roles}")
        return roles

    @field_validator("trainable_statuses")
    @classmethod
    def _known_statuses(cls, statuses: list[str]) -> list[str]:
        _only(statuses, STATUSES, "statuses")
        if "eval_failed" in statuses:
            raise ValueError("eval_failed executions have no trustworthy reward and are never trained on")
        if "abandoned" in statuses:
            raise ValueError("abandoned executions were replaced by a new attempt and have no reward")
        return statuses


class PackingConfig(BaseModel):
    """How training trees become packed sequences for the trainer."""

    token_budget: int = Field(
        32768, ge=16, description="tokens per packed sequence; must hold the longest selected trajectory"
    )
    advantage: Literal["grpo", "positive", "mean", "rloo"] = Field(
        "grpo",
        description="group-relative advantage: grpo = (r - mean) / (std + eps); positive = grpo's, 0 where "
        "below the group's mean (only the better executions are reinforced: rejection-sampling fine-tuning "
        "weighted by the advantage); mean = r - mean; rloo = r - mean of the others in the group",
    )
    advantage_eps: float = Field(1e-6, gt=0, description="added to the group std (grpo)")
    share_prefixes: bool = Field(
        True,
        description="a tree whose first context run starts like the previous tree's in the same sequence "
        "(the system prompt and tools; a group's whole first prompt) is attached to that run's tokens "
        "instead of repeating them: the same targets, logprobs and gradients, fewer tokens to compute",
    )


def _only(values: list[str], known: tuple[str, ...], what: str) -> None:
    unknown = [v for v in values if v not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; expected some of {list(known)}")
