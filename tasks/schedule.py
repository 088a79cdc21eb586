"""The scheduler on a campaign's services: the campaign's pieces the scheduler's loop drives
(scheduler/service.py), the process that runs that loop, and the Prefect task that supervises it.

    runtime = CampaignRuntime(services, store, dispatch_config, selection, packing, trainer, policy)
    controller = Controller(make_policy("elastic"), pool, runtime, sessions_per_cell=2)

    python -m tasks.schedule < job.json     # a ScheduleJob on stdin: the steps from job.start on,
                                            # a heartbeat line every tick, each step committed
    run_scheduler(job)                      # the campaign's long-running task: starts that process,
                                            # restarts it from the store if it dies or goes silent

``CampaignRuntime`` is scheduler.service.Campaign on real services: one execution through the
dispatcher, one group packed as a chunk, the core's streaming step (tasks/train.py CoreService),
engine weights, a step's work, and the commit of a step through tasks/commit.py's commit_step (the
same recipe as the step flow's).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from engines.admin import AdminClient
from engines.devices import CellDevices
from engines.quantiles import quantile
from engines.train.config import TrainerConfig
from engines.train.run import TrainStepReport, TrainStepRequest
from engines.train.stream import write_chunk
from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig
from environments.ledger import StepLedger, group_id_for, step_ledger
from environments.problems import Problem
from environments.runner import builtin_harness_env
from environments.zygote import Zygote
from scheduler.cells import Switch
from scheduler.controller import Chunk, StepWork
from scheduler.report import Outcome, StepDone
from scheduler.service import SchedulerConfig, cell_pool, schedule_steps
from tasks.commit import StepRecord, StepTimes, commit_step, last_committed, write_metric_rows, write_metrics
from tasks.problems import ProblemsConfig, step_problems
from tasks.services.campaign import Services, ServingConfig, policy_path, serve_version
from tasks.train import CoreService, CoreStep, step_request
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.processor import pack
from trajectory_store.step import left_out, step_figures
from trajectory_store.storage import Store, StoreConfig

__all__ = ["CampaignRuntime", "ScheduleJob", "SchedulerConfig", "run_scheduler"]


class CampaignRuntime:
    """A campaign's pieces on its services (scheduler.service.Campaign): executions through the
    dispatcher, groups packed from the store, the core as one process for every step, engine weights,
    and each step's problems (from ``problems``) and commit."""

    def __init__(
        self,
        services: Services,
        store: StoreConfig,
        dispatch_config: DispatchConfig,
        selection: SelectionConfig,
        packing: PackingConfig,
        trainer: TrainerConfig,
        init_model: str,
        *,
        max_policy_lag: int = 1,
        trainer_threads: int = 1,
        seed: int = 0,
        problems: ProblemsConfig | None = None,
        trainer_cell: CellDevices | None = None,
    ):
        self.services, self.store, self.config = services, store, dispatch_config
        self.problems = problems  # None: the caller hands the controller its StepWork itself
        self.selection, self.packing, self.trainer = selection, packing, trainer
        self.init_model, self.max_policy_lag = init_model, max_policy_lag
        self.trainer_threads, self.seed = trainer_threads, seed
        self.trainer_cell = trainer_cell  # the core's GPUs and cores (ServingConfig.trainer_cell)
        self.core: CoreService | None = None
        self.ledgers: dict[int, StepLedger] = {}
        self.zygote: Zygote | None = None  # one warm harness launcher for every execution it dispatches

    async def execute(self, step: int, problem: dict[str, Any], member: int) -> Outcome:
        chosen = Problem.from_json(problem)
        config = replace(self.config, step=step, campaign=self.store.campaign)
        if step not in self.ledgers:  # read once a step: this process dispatches each member once
            self.ledgers[step] = step_ledger(self.store, step)
        if self.zygote is None:
            self.zygote = Zygote(builtin_harness_env())
        outcomes = await dispatch(
            [chosen],
            self.services.gateway_url,
            self.services.admin_token.get_secret_value(),
            self.store,
            config,
            {chosen.problem_id: [member]},
            ledger=self.ledgers[step],
            zygote=self.zygote,
        )
        o = outcomes[0]
        return Outcome(o.execution_id, o.group_id, o.status, float(o.reward or 0.0))

    def pack_group(self, step: int, problem: dict[str, Any]) -> Chunk | None:
        """The group's executions (trees, selection, group-relative advantages), packed as one chunk;
        None when the group carries no signal or nothing in it is trainable."""
        group = group_id_for(step, Problem.from_json(problem), self.config.run_id)
        target = Store(self.store)
        con = connect(target, self.selection)
        others = con.execute(
            "SELECT execution_id FROM executions WHERE step = ? AND coalesce(group_id, '') <> ?",
            [step, group],
        ).fetchall()
        exclude = left_out(
            con, step, trained_version=step, max_policy_lag=self.max_policy_lag, skip_zero_signal=True
        )
        exclude |= {row[0]: "another group" for row in others}
        batch = pack(con, self.packing, step=step, exclude=exclude)
        con.close()
        if not batch.sequences:
            return None
        uri = target.url(target.path(f"batches/step={step}/{group}.parquet"))
        write_chunk(batch.sequences, uri, step)
        return Chunk(uri, len(batch.sequences), len(batch.advantages))

    def prepare(self, step: int) -> float:
        """The core process started and restored at ``step`` before the controller's clock: the
        seconds it took (a start-up on the core cell's share, paid once a campaign)."""
        started = time.perf_counter()
        self._core().prepare(self._request(step))
        return time.perf_counter() - started

    def start_training(self, step: int) -> CoreStep:
        return self._core().step(self._request(step))  # no batch: the step streams

    def _core(self) -> CoreService:
        if self.core is None:
            self.core = CoreService(self.trainer_threads, self.trainer_cell)
        return self.core

    def _request(self, step: int) -> TrainStepRequest:
        return step_request(
            step, self.services, self.init_model, self.trainer, threads=self.trainer_threads, seed=self.seed
        )

    async def aclose(self) -> None:
        """Ends what lives in the event loop (the harness zygote); call before the loop ends."""
        if self.zygote is not None:
            await self.zygote.close()
            self.zygote = None

    def close(self) -> None:
        if self.core is not None:
            self.core.close()

    def weights_path(self, version: int) -> str:
        return policy_path(self.services, version, self.init_model)

    def serve(self, engine_urls: list[str], version: int) -> None:
        serve_version(self.services, engine_urls, version, self.weights_path(version))

    def step_work(self, step: int) -> StepWork:
        """The step's problems, ``group_size`` members each; the members the store holds as ended (any
        attempt but an abandoned one) are finished, never dispatched again."""
        if self.problems is None:
            raise ValueError("this runtime was made without [problems]: give the controller its StepWork")
        problems = step_problems(self.problems, step)
        ledger = step_ledger(self.store, step)
        finished = {}
        for p in problems:
            for m in range(self.config.group_size):
                if (row := ledger.outcome(Problem.from_json(p), m)) is not None:
                    reward = float(row.reward or 0.0)
                    finished[(p["problem_id"], m)] = Outcome(
                        row.execution_id, row.group_id or "", row.status, reward
                    )
        return StepWork(step, problems, self.config.group_size, finished)

    def commit(self, done: StepDone, report: TrainStepReport, switches: list[Switch]) -> int:
        """The step through the campaign's one commit recipe (tasks/commit.py commit_step): its
        executions' figures as a step flow's (by status, abandoned too; reward, pass rate, tokens), the
        groups trained and skipped, and its switches (counted, p50 per direction, and one metrics row
        per switch and phase). Returns the version committed."""
        con = connect(Store(self.store), self.selection)
        try:
            figures = step_figures(con, done.step)
        finally:
            con.close()
        figures |= switch_figures(switches)
        figures |= {
            "groups_trained": float(done.groups_trained),
            "groups_skipped": float(done.groups_skipped),
        }
        times = StepTimes(started=done.started_at, rolled_out=done.rolled_out_at, ended=done.ended_at)
        record: StepRecord = commit_step.fn(self.store, report, figures, times)
        write_switch_metrics(self.store, done.step, switches)
        return record.version


def write_switch_metrics(store: StoreConfig, step: int, switches: list[Switch]) -> None:
    """Every switch of a step as metrics rows: its total and each phase, with its cell and what it
    moved (detail: JSON), so `gyre sql` answers "how long did drains take, per cell"."""
    rows: list[tuple[str, float, str | None, str, float]] = []
    for switch in switches:
        detail = json.dumps(switch.detail, sort_keys=True, default=str)
        rows.append((f"switch_to_{switch.to}_s", switch.seconds, switch.cell_id, detail, switch.started))
        for phase, seconds in switch.phases.items():
            rows.append((f"switch_to_{switch.to}_{phase}_s", seconds, switch.cell_id, detail, switch.started))
    write_metric_rows(store, step, rows, f"switches-{step}")


def switch_figures(switches: list[Switch]) -> dict[str, float]:
    """A step's switches: how many, and the p50 seconds of each direction that happened."""
    figures = {"switches": float(len(switches))}
    for role in ("train", "rollout"):
        p50 = quantile([s.seconds for s in switches if s.to == role], 0.5)
        if p50 is not None:
            figures[f"switch_to_{role}_p50_s"] = p50
    return figures


# -- the scheduler as a process, and its supervisor ------------------------------------------------

log = logging.getLogger("gyre.scheduler")


class ScheduleJob(BaseModel):
    """Everything the scheduler process needs, as JSON on its stdin (admin tokens included: never in
    argv or on disk)."""

    scheduler: SchedulerConfig
    policy: str  # the starting policy (version 0)
    steps: int
    start: int
    seed: int
    max_policy_lag: int
    store: StoreConfig
    problems: ProblemsConfig
    dispatch: DispatchConfig
    selection: SelectionConfig
    packing: PackingConfig
    trainer: TrainerConfig
    serving: ServingConfig = ServingConfig()  # each cell's devices: its replica's and the core's
    services: Services  # its tokens are secrets: shown masked, sent in the clear only on the pipe

    def wire(self) -> str:
        """The job as the process reads it (the tokens revealed: stdin only, never argv or disk)."""
        plain = self.model_dump(mode="json")
        plain["services"]["admin_token"] = self.services.admin_token.get_secret_value()
        plain["services"]["engine_admin_token"] = self.services.engine_admin_token.get_secret_value()
        return json.dumps(plain)


def main() -> int:
    """The scheduler process: a ScheduleJob on stdin; the campaign's runtime and cells built from it,
    then the loop (scheduler/service.py), its lines on stdout."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    job = ScheduleJob.model_validate_json(sys.stdin.readline())
    services = job.services
    if len(services.engine_urls) < 2:
        raise ValueError(
            f"the scheduler needs at least 2 cells (serving.engines); got {len(services.engine_urls)}"
        )
    admin = AdminClient(
        services.gateway_url,
        services.admin_token.get_secret_value(),
        services.engine_admin_token.get_secret_value(),
    )
    serving = job.serving
    # a running `gyre up` stack may have other engines than this config names: then no cell is placed
    placed = len(services.engine_urls) == serving.engines
    cells = [services.in_cell(serving.engine_cell(i), i) for i in range(serving.engines)] if placed else None
    pool = cell_pool(admin, services.engine_urls, job.policy, cells)
    runtime = CampaignRuntime(
        services,
        job.store,
        job.dispatch,
        job.selection,
        job.packing,
        job.trainer,
        job.policy,
        max_policy_lag=job.max_policy_lag,
        seed=job.seed,
        problems=job.problems,
        trainer_cell=services.in_cell(serving.trainer_cell(), 0) if placed else None,
    )
    schedule_steps(
        runtime,
        pool,
        job.scheduler,
        start=job.start,
        steps=job.steps,
        max_policy_lag=job.max_policy_lag,
        heartbeat=lambda line: print(line, flush=True),
    )
    return 0


class SchedulerDied(RuntimeError):
    pass


def _watch(job: ScheduleJob, on_line, argv: list[str] | None = None) -> int:
    """One scheduler process, from start to exit: its lines go to `on_line`; killed (with every
    process it started: its own session) when it says nothing for heartbeat_timeout_s. Its exit
    code, or -1 for silence; a killed scheduler is noticed within a second, not at the timeout.
    ``argv`` (tests): another program in its place."""
    process = subprocess.Popen(
        argv or [sys.executable, "-m", "tasks.schedule"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    )
    process.stdin.write(job.wire() + "\n")
    process.stdin.close()
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    def take(line: str) -> None:
        if line.startswith("{"):
            on_line(json.loads(line), process.pid)

    threading.Thread(target=read, daemon=True).start()
    timeout = job.scheduler.heartbeat_timeout_s
    heard = time.monotonic()
    try:
        while True:
            try:
                line = lines.get(timeout=min(1.0, timeout))
            except queue.Empty:
                # its end shows here, not as the pipe's end: what it started (engines, the trainer)
                # holds the pipe open after it is killed, so a dead scheduler waited out the timeout
                if process.poll() is not None:
                    with contextlib.suppress(queue.Empty):  # a last line still on its way
                        while (line := lines.get(timeout=0.2)) is not None:
                            take(line)
                    log.warning("the scheduler (pid %d) exited with %d", process.pid, process.returncode)
                    return process.returncode
                if time.monotonic() - heard >= timeout:
                    log.warning(
                        "the scheduler (pid %d) said nothing for %.0f s: killing it", process.pid, timeout
                    )
                    return -1
                continue
            heard = time.monotonic()
            if line is None:
                return process.wait()
            take(line)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the scheduler and whatever it started
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@task(name="scheduler", task_run_name="scheduler steps {job.start}-{last_step}", cache_policy=NO_CACHE)
def run_scheduler(job: ScheduleJob, last_step: int, on_line=None) -> dict[str, Any]:
    """The campaign's scheduler service: a process that runs the steps, supervised. A scheduler that
    exits with an error, is killed, or goes silent (no heartbeat for heartbeat_timeout_s) is killed
    with everything it started and started again from the store: after the last committed step, with
    the executions that ended counted, not dispatched again. Restarts are counted in the metrics."""
    restarts: list[dict[str, Any]] = []
    done: dict[str, Any] = {}

    def seen(message: dict[str, Any], pid: int) -> None:
        if "done" in message:
            done.update(message["done"])
        if on_line is not None:
            on_line(message, pid)

    while True:
        code = _watch(job, seen)
        if code == 0 and done:
            return {**done, "restarts": restarts}
        last = last_committed.fn(job.store)
        start = last.step + 1 if last else 0
        restarts.append({"exit": code, "at_step": start, "t": time.time()})
        write_metrics(  # a part per restart: two restarts at one step never collide
            job.store,
            start,
            {"scheduler_restarts": float(len(restarts))},
            time.time(),
            f"scheduler-r{len(restarts)}",
        )
        if start >= job.steps:
            return {"version": job.steps, "restarts": restarts}
        if len(restarts) > job.scheduler.restarts:
            raise SchedulerDied(f"the scheduler died {len(restarts)} times (last exit {code}); see its log")
        log.warning("the scheduler exited with %s at step %d: restarting it from the store", code, start)
        job = job.model_copy(update={"start": start})


if __name__ == "__main__":
    sys.exit(main())
