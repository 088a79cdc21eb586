"""Prefect tasks over the policy model: initialize one (tokenizer + random weights) at any URL.

``init_model`` is deterministic (the same preset and seed give the same files), so rerunning it with
``force=True`` after a failure gives the same model. It has no automatic retries: a partial copy
leaves a non-empty destination, which a plain rerun refuses by design.
"""

from __future__ import annotations

from prefect import task

from engines.model import build
from engines.model.build import InitResult
from engines.model.config import ModelConfig

__all__ = ["InitResult", "ModelConfig", "init_model"]


@task(name="init-model", task_run_name="init {preset} model at {out}")
def init_model(
    preset: str,
    out: str,
    seed: int = 0,
    force: bool = False,
    s3_endpoint_url: str | None = None,
    family: str = "qwen2",
) -> InitResult:
    """The model's files at ``out`` (any fsspec URL) and what they hold."""
    return build.init_model(
        ModelConfig(preset=preset, seed=seed, family=family),
        out,
        force=force,
        s3_endpoint_url=s3_endpoint_url,
    )
