"""Prefect tasks over the policy model: initialize one (tokenizer + random weights) at any URL.

``init_model`` is deterministic (the same preset and seed give the same files), so rerunning it with
``force=True`` after a failure gives the same model. It has no automatic retries: a partial copy
leaves a non-empty destination, which a plain rerun refuses by design.
"""

from __future__ import annotations

from prefect import task
from pydantic import BaseModel

from engines.model import build
from engines.model.config import ModelConfig

__all__ = ["ModelConfig", "ModelSummary", "init_model"]


class ModelSummary(BaseModel):
    out: str
    preset: str
    seed: int
    dtype: str
    parameters: int
    vocab_size: int
    files: list[str]


@task(name="init-model", task_run_name="init {preset} model at {out}")
def init_model(
    preset: str,
    out: str,
    seed: int = 0,
    force: bool = False,
    s3_endpoint_url: str | None = None,
) -> ModelSummary:
    result = build.init_model(
        ModelConfig(preset=preset, seed=seed), out, force=force, s3_endpoint_url=s3_endpoint_url
    )
    return ModelSummary(
        out=result.out,
        preset=result.preset,
        seed=result.seed,
        dtype=result.dtype,
        parameters=result.parameters,
        vocab_size=result.vocab_size,
        files=result.files,
    )
