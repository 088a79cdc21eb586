"""CampaignConfig: every layer's typed config in one object, loaded from TOML, usable as flow parameters.

    config = CampaignConfig.from_toml("configs/demo.toml")

Each section goes only to the layer it belongs to: [store] -> storage, [selection] -> the DuckDB
selection views, [packing] -> the processor, [problems] and [evaluation] -> the campaign's problem
choice, [dispatch] -> the dispatcher and the harness, [trainer] -> the core cell, [serving] -> the
processes the campaign starts, [scheduler] -> who decides the cells' roles (scheduler/service.py),
[tracking] -> where its figures are mirrored (MLflow, TensorBoard: tasks/tracking.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from tasks.configs import (
    ClusterConfig,
    DispatchConfig,
    EvaluationConfig,
    PackingConfig,
    ProblemsConfig,
    SchedulerConfig,
    SelectionConfig,
    ServingConfig,
    StoreConfig,
    TrackingConfig,
    TrainerConfig,
)


class CampaignConfig(BaseModel):
    name: str = Field(
        "demo", description="the campaign: its folder under the data root and its Prefect run name"
    )
    trace: str | None = Field(
        None, description="JSONL trace the store demo imports (default: the bundled sample)"
    )
    policy: str = Field("data/policies/tiny-sft", description="HF folder of the starting policy (version 0)")
    steps: int = Field(4, ge=0, description="optimizer steps (policy versions) the campaign makes in all")
    seed: int = Field(0, description="seeds the trainer; problems derive from [problems].seed and the step")
    max_policy_lag: int = Field(
        0,
        ge=0,
        description="an execution with a call sampled more than this many versions before the one being "
        "trained is left out (counted as stale); colocate never has lag",
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="the newest checkpoints kept (published policies stay)"
    )
    store: StoreConfig = Field(default_factory=StoreConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    packing: PackingConfig = Field(default_factory=PackingConfig)
    problems: ProblemsConfig = Field(default_factory=ProblemsConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    dispatch: DispatchConfig = Field(default_factory=DispatchConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    cluster: ClusterConfig | None = Field(
        None, description="the hosts the cells run on (None: every engine on this machine)"
    )

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """Refuses a key no section knows, naming the nearest valid one: a typo such as ``step = 3``
        beside ``steps = 8`` would otherwise be ignored and the campaign would run without it."""
        if isinstance(data, dict):
            problems = unknown_keys(cls, data)
            if problems:
                raise ValueError("\n  ".join(problems))
        return data

    @model_validator(mode="after")
    def _one_update_when_streaming(self) -> CampaignConfig:
        if self.scheduler.policy is not None and self.trainer.updates_per_step > 1:
            raise ValueError(
                f"[trainer] mini_batches = {self.trainer.mini_batches} and epochs = {self.trainer.epochs}: "
                f"the scheduler's steps stream (policy {self.scheduler.policy!r}) and make one update each; "
                "set both to 1, or leave [scheduler] policy unset"
            )
        if self.scheduler.policy is not None and self.problems.zero_signal == "top_up":
            raise ValueError(
                f'[problems] zero_signal = "top_up" with [scheduler] policy = {self.scheduler.policy!r}: the '
                "scheduler's steps stream their groups into training as they finish, so a step cannot roll out "
                'another round after it has seen its groups; use "skip" (zero-signal groups are left out) or '
                '"keep", or leave [scheduler] policy unset'
            )
        if self.scheduler.policy is not None and self.cluster is not None:
            _scheduler_on_hosts(self.scheduler.policy, self.cluster)
        return self

    def merged(self, overrides: dict) -> CampaignConfig:
        """A copy with ``overrides`` (a partial config) merged in, section by section, validated."""

        def merge(base: dict, extra: dict) -> dict:
            out = dict(base)
            for key, value in extra.items():
                out[key] = (
                    merge(out[key], value)
                    if isinstance(value, dict) and isinstance(out.get(key), dict)
                    else value
                )
            return out

        return CampaignConfig.model_validate(merge(self.model_dump(), overrides))

    @classmethod
    def from_toml(cls, path: str | Path) -> CampaignConfig:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"campaign config {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"campaign config {path} is not valid TOML: {exc}") from None
        try:
            config = cls.model_validate(data)
        except ValidationError as exc:  # one line per problem, each with where it is in the file
            lines = []
            for error in exc.errors():
                where = ".".join(str(part) for part in error["loc"])
                message = error["msg"].removeprefix("Value error, ")
                lines.append(f"[{where}] {message}" if where else message)
            raise ValueError(f"campaign config {path}: " + "\n  ".join(lines)) from None
        # a suite's path is the file's neighbour, wherever the campaign runs from
        config.problems = config.problems.relative_to(Path(path).resolve().parent)
        return config


def _sections(annotation: Any) -> list[type]:
    """The config classes (pydantic models, dataclasses) an annotation names, through ``X | None``."""
    if isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)
    ):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(annotation) for c in _sections(arg)]
    return []


def _fields(section: type) -> dict[str, Any]:
    """Key -> annotation of a config class (aliases count as keys too)."""
    if issubclass(section, BaseModel):
        found = {}
        for name, info in section.model_fields.items():
            found[name] = info.annotation
            if info.alias:
                found[info.alias] = info.annotation
        return found
    hints = typing.get_type_hints(section)
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(section)}


def unknown_keys(section: type, data: dict[str, Any], where: str = "") -> list[str]:
    """Every key of ``data`` (a config as TOML or JSON gives it) that ``section`` and its nested sections
    do not know, each with where it is and the nearest valid names."""
    fields = _fields(section)
    problems = []
    for key, value in data.items():
        if key not in fields:
            near = difflib.get_close_matches(key, list(fields), n=2, cutoff=0.75)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            place = f"[{where}]" if where else "the top level"
            problems.append(
                f"unknown key {key!r} in {place} of the campaign config{hint} (valid: {', '.join(fields)})"
            )
            continue
        nested = _sections(fields[key])
        if isinstance(value, dict) and len(nested) == 1:
            problems += unknown_keys(nested[0], value, f"{where}.{key}" if where else key)
    return problems


def _scheduler_on_hosts(policy: str, cluster: ClusterConfig) -> None:
    """What the scheduler does not yet do on hosts is refused, with why (docs/cluster.md)."""
    cells = sum(h.cells for h in cluster.hosts)
    prefix = f"[scheduler] policy = {policy!r} with [cluster]"
    if cells < 2:
        raise ValueError(
            f"{prefix}: the scheduler needs at least 2 cells (one is the core's); hosts place {cells}"
        )
    if cluster.core_hosts:
        raise ValueError(
            f"{prefix} core_hosts = {cluster.core_hosts}: the scheduler's core is one process for the whole "
            "campaign, not a world of ranks on hosts (yet); leave core_hosts empty (the cells' replicas on the "
            "hosts join its steps), or leave [scheduler] policy unset"
        )
    if cluster.gateways > 1:
        raise ValueError(
            f"{prefix} gateways = {cluster.gateways}: the scheduler dispatches through one gateway (yet); "
            "set gateways = 1, or leave [scheduler] policy unset"
        )
