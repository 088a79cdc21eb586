"""Prefect tasks over training: one campaign step's update in a trainer process of its own.

``train_step`` starts ``python -m engines.train.run`` with the step's TrainStepRequest on stdin and
reads its TrainStepReport. A trainer that dies (killed, out of memory) fails the task, which Prefect
retries: the new process restores the previous step's checkpoint and makes the same update, so a
retry never trains a sample twice. The process keeps the DeepSpeed engine, its distributed state and
its memory out of the flow's process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from prefect import task
from prefect.runtime import task_run

from engines.train.config import LossConfig, TrainerConfig
from engines.train.run import TrainStepReport, TrainStepRequest

__all__ = ["LossConfig", "TrainStepReport", "TrainStepRequest", "TrainerConfig", "train_step"]


def run_trainer_process(request: TrainStepRequest, env: dict[str, str] | None = None) -> TrainStepReport:
    """Runs one step in a fresh process; its log is in the error when it fails."""
    environment = {**os.environ, **(env or {})}
    environment.update(OMP_NUM_THREADS=str(request.threads), MKL_NUM_THREADS=str(request.threads))
    with tempfile.TemporaryFile() as log:
        process = subprocess.run(
            [sys.executable, "-m", "engines.train.run"],
            input=request.model_dump_json().encode(),
            stdout=subprocess.PIPE,
            stderr=log,
            env=environment,
            check=False,
        )
        if process.returncode != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(
                f"the trainer of step {request.step} exited with {process.returncode}:\n{tail}"
            )
    lines = process.stdout.decode().strip().splitlines()
    if not lines:
        raise RuntimeError(f"the trainer of step {request.step} printed no report")
    return TrainStepReport.model_validate_json(lines[-1])


@task(name="train", task_run_name="train step {request.step}", retries=2, retry_delay_seconds=2)
def train_step(request: TrainStepRequest, env: dict[str, str] | None = None) -> TrainStepReport:
    report = run_trainer_process(request, env)
    report.metrics["train_attempts"] = float(task_run.run_count or 1)  # > 1: a trainer died, retried
    return report
