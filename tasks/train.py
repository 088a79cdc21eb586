"""Prefect tasks over training: one campaign step's update in a trainer process of its own, and the
core as one long-lived process for the scheduler's streaming steps.

``train_step`` starts ``python -m engines.train.run`` with the step's TrainStepRequest on stdin and
reads its TrainStepReport. A trainer that dies (killed, out of memory) fails the task, which Prefect
retries: the new process restores the previous step's checkpoint and makes the same update, so a
retry never trains a sample twice. The process keeps the DeepSpeed engine, its distributed state and
its memory out of the flow's process.

``CoreService`` runs ``python -m engines.train.run --serve`` once for the scheduler (tasks/schedule.py):
a step request per stdin line; per step its streaming address, then its TrainStepReport, one JSON line
each. ``CoreStep`` is one such step as scheduler.controller.Training.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.runtime import task_run
from pydantic import BaseModel

from engines.devices import CellDevices, process_env
from engines.net import free_port
from engines.train.config import CoreWorld, LossConfig, TrainerConfig
from engines.train.run import TrainStepReport, TrainStepRequest
from engines.train.stream import StreamProducer
from stack.campaign import Services, running_fleets
from stack.cluster_config import ClusterConfig
from stack.core_ranks import cancel_core_ranks, start_core_ranks, wait_core_ranks

if TYPE_CHECKING:
    from scheduler.controller import Chunk


class BatchSummary(BaseModel):
    """A step's packed batch (tasks/steps.py pack): where it is (None: nothing to train), how many
    executions it trains, and the step's figures."""

    uri: str | None
    n_executions: int
    figures: dict[str, float]


__all__ = [
    "LossConfig",
    "TrainStepReport",
    "TrainStepRequest",
    "TrainerConfig",
    "step_request",
    "train_step",
]


def step_request(
    step: int,
    services: Services,
    init_model: str,
    trainer: TrainerConfig,
    *,
    threads: int,
    seed: int,
    batch: BatchSummary | None = None,
) -> TrainStepRequest:
    """Step ``step`` of a campaign on ``services``: it resumes the previous step's checkpoint (the
    starting policy at step 0), writes its own and publishes under the campaign's folder; it trains
    ``batch`` (the step flow), or without one the chunks streamed to it (the scheduler)."""
    root = services.policy_root
    return TrainStepRequest(
        step=step,
        init_model=init_model,
        resume_from=f"{root}/checkpoints/step={step - 1}" if step > 0 else None,
        batch_uri=batch.uri if batch else None,
        n_executions=batch.n_executions if batch else 0,
        checkpoint_url=f"{root}/checkpoints/step={step}",
        policy_root=root,
        fast_dir=services.fast_dir,
        trainer=trainer,
        threads=threads,
        seed=seed,
        stream=batch is None,
    )


def trainer_env(threads: int, cell: CellDevices | None = None) -> dict[str, str]:
    """The trainer process's environment: this one's, with its cell's GPUs and cores (ServingConfig's
    trainer_cell; None: none named) and ``threads`` threads."""
    cell = (cell or CellDevices()).model_copy(update={"threads": threads})
    return {**os.environ, **process_env(cell)}


def run_trainer_process(
    request: TrainStepRequest, env: dict[str, str] | None = None, cell: CellDevices | None = None
) -> TrainStepReport:
    """Runs one step in a fresh process (on ``cell``'s devices); its log is in the error when it fails."""
    environment = {**trainer_env(request.threads, cell), **(env or {})}
    line = _last_line(["engines.train.run"], request, environment, f"the trainer of step {request.step}")
    return TrainStepReport.model_validate_json(line)


def run_core_rank(request: TrainStepRequest, rank: int, address: str) -> dict[str, Any]:
    """Rank ``rank`` of the request's core, on this host at ``address``, for the request's step
    (``python -m engines.train.peer``); its report (updates made, optimizer state bytes held)."""
    argv = ["engines.train.peer", "--rank", str(rank), "--address", address]
    what = f"core rank {rank} of step {request.step}"
    return json.loads(_last_line(argv, request, trainer_env(request.threads), what))


def _last_line(module: list[str], request: TrainStepRequest, env: dict[str, str], what: str) -> str:
    with tempfile.TemporaryFile() as log:
        process = subprocess.run(
            [sys.executable, "-m", *module],
            input=request.model_dump_json().encode(),
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            check=False,
        )
        if process.returncode != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{tail}")
    lines = process.stdout.decode().strip().splitlines()
    if not lines:
        raise RuntimeError(f"{what} printed no report")
    return lines[-1]


def core_request(request: TrainStepRequest, cluster: ClusterConfig) -> TrainStepRequest:
    """``request`` for a core with a rank on each of ``cluster.core_hosts``: rank 0 (this machine) opens
    the rendezvous on a fresh port of the gateway address, and every rank starts from the starting
    policy's copy in object storage (a store on a local disk: the hosts share it)."""
    root = request.policy_root.rstrip("/")
    remote = "://" in root and not root.startswith("file://")
    return request.model_copy(
        update={
            "core": CoreWorld(
                address=cluster.gateway_address or "127.0.0.1",
                port=free_port(),
                size=1 + len(cluster.core_hosts),
            ),
            "init_model": f"{root}/policy/start" if remote else request.init_model,
        }
    )


@task(name="train", task_run_name="train step {request.step}", retries=2, retry_delay_seconds=2)
def train_step(
    request: TrainStepRequest,
    env: dict[str, str] | None = None,
    cell: CellDevices | None = None,
    cluster: ClusterConfig | None = None,
) -> TrainStepReport:
    """The step in a trainer process; with ``cluster.core_hosts``, that process is rank 0 of a core
    whose other ranks run as flow runs on those hosts (each attempt starts its own)."""
    if cluster is None or not cluster.core_hosts:
        report = run_trainer_process(request, env, cell)
    else:
        request = core_request(request, cluster)
        # the hosts the campaign's cell fleet has found lost (this process runs it): their ranks move
        lost = set().union(*(fleet.lost for fleet in running_fleets() if fleet.cluster == cluster))
        runs = start_core_ranks(cluster, request.model_dump(mode="json"), request.step, lost)
        try:
            report = run_trainer_process(request, env, cell)
        except BaseException:
            cancel_core_ranks(runs)
            raise
        wait_core_ranks(runs)
        report.metrics["core_ranks"] = float(request.core.size)
    report.metrics["train_attempts"] = float(task_run.run_count or 1)  # > 1: a trainer died, retried
    return report


class CoreService:
    """The core as one long-lived process (`python -m engines.train.run --serve`): a step request per
    stdin line; per step, its streaming address (one JSON line) and then its report (the next)."""

    def __init__(self, threads: int, cell: CellDevices | None = None):
        env = trainer_env(threads, cell)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engines.train.run", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):  # its JSON lines; libraries print other things
                self.lines.put(line.strip())
        self.lines.put(None)  # the process ended

    def next_line(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the core said nothing for {timeout_s:.0f} s, waiting for {what}") from None
        if line is None:
            raise RuntimeError(f"the core's process ended (exit {self.process.wait()}) before {what}")
        return json.loads(line)

    def prepare(self, request: TrainStepRequest, timeout_s: float = 600) -> dict[str, Any]:
        """The core restored at ``request.step``, nothing trained; its answer: ``step``, ``seconds``
        and ``restored`` (False: it was at that step already). Its start-up then never shares the
        core cell with the cell's rollout, and the step's own request opens at once."""
        self.process.stdin.write(request.model_copy(update={"prepare": True}).model_dump_json() + "\n")
        self.process.stdin.flush()
        answer = self.next_line(timeout_s, f"the core to restore step {request.step}")["prepared"]
        if answer["step"] != request.step:
            raise RuntimeError(f"the core restored step {answer['step']}, not step {request.step}")
        return answer

    def step(self, request: TrainStepRequest) -> CoreStep:
        self.process.stdin.write(request.model_dump_json() + "\n")
        self.process.stdin.flush()
        return CoreStep(self, request.step)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


class CoreStep:
    """One streaming step of the core service (scheduler.controller.Training)."""

    def __init__(self, service: CoreService, step: int):
        self.service, self.step = service, step
        self._address: tuple[str, int, int] | None = None
        self._producer: StreamProducer | None = None
        self._lock = threading.Lock()

    def _check_alive(self) -> None:
        """Raises at once when the core's process has ended: its stream would otherwise be waited on
        (a TCPStore connection retries for its whole timeout) until the heartbeat timeout."""
        code = self.service.process.poll()
        if code is not None:
            raise RuntimeError(f"the core's process ended (exit {code}) during step {self.step}")

    def address(self) -> tuple[str, int, int]:
        self._check_alive()
        with self._lock:
            if self._address is None:
                spec = self.service.next_line(300, f"step {self.step} to open")["stream"]
                self._address = (spec["host"], int(spec["port"]), int(spec["step"]))
            return self._address

    def _stream(self) -> StreamProducer:
        self._check_alive()
        if self._producer is None:
            # the core opened the step (its address line says so): a connection that takes longer is to
            # a core that died since
            self._producer = StreamProducer(*self.address(), timeout_s=60.0)
        return self._producer

    def append(self, chunk: Chunk, key: str) -> None:
        self._stream().append(chunk.uri, chunk.sequences, chunk.executions, key=key)

    def close(self) -> None:
        self._stream().close()

    def wait(self) -> TrainStepReport:
        return TrainStepReport.model_validate(self.service.next_line(600, f"the report of step {self.step}"))
