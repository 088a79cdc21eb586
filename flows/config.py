"""CampaignConfig: every layer's typed config in one object, loaded from TOML, usable as flow parameters.

    config = CampaignConfig.from_toml("configs/demo.toml")

Each section goes only to the layer it belongs to: [store] -> storage, [selection] -> the DuckDB
selection views, [packing] -> the processor, [problems] and [evaluation] -> the campaign's problem
choice, [dispatch] -> the dispatcher and the harness, [trainer] -> the core cell, [serving] -> the
processes the campaign starts, [scheduler] -> who decides the cells' roles (scheduler/service.py).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from tasks.campaign import DispatchConfig, EvaluationConfig, ProblemsConfig
from tasks.schedule import SchedulerConfig
from tasks.services.campaign import ServingConfig
from tasks.train import TrainerConfig
from tasks.trajectory import PackingConfig, SelectionConfig, StoreConfig


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

    @model_validator(mode="after")
    def _one_update_when_streaming(self) -> CampaignConfig:
        if self.scheduler.policy is not None and self.trainer.updates_per_step > 1:
            raise ValueError(
                f"[trainer] mini_batches = {self.trainer.mini_batches} and epochs = {self.trainer.epochs}: "
                f"the scheduler's steps stream (policy {self.scheduler.policy!r}) and make one update each; "
                "set both to 1, or leave [scheduler] policy unset"
            )
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
        return cls.model_validate(data)
