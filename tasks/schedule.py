"""The scheduler on a campaign's services: its runtime (one execution, one group packed, the core's
streaming step as a process, engine weights: scheduler/controller.py drives it), the scheduler as a
process of its own, and the supervisor that keeps that process alive.

    runtime = CampaignRuntime(services, store, dispatch_config, selection, packing, trainer, policy)
    controller = Controller(make_policy("elastic"), pool, runtime, sessions_per_cell=2)

    python -m tasks.schedule < job.json     # a ScheduleJob on stdin: the steps from job.start on,
                                            # a heartbeat line every tick, each step committed
    run_scheduler(job)                      # the campaign's long-running task: starts that process,
                                            # restarts it from the store if it dies or goes silent
"""

from __future__ import annotations

import asyncio
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
from typing import Any, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from engines.train.config import TrainerConfig
from engines.train.run import TrainStepRequest
from engines.train.stream import StreamProducer, write_chunk
from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig
from environments.ledger import StepLedger, group_id_for, step_ledger
from environments.problems import Problem
from environments.runner import builtin_harness_env
from environments.zygote import Zygote
from scheduler.cells import Admin, CellPool, CellSpec
from scheduler.controller import Chunk, Controller, Outcome, StepWork
from scheduler.policy import make_policy
from tasks.campaign import (
    ProblemsConfig,
    StepRecord,
    choose_problems,
    commit_step,
    write_metric_rows,
    write_metrics,
)
from tasks.services import Services, policy_path, serve_version
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.processor import pack
from trajectory_store.step import left_out, step_figures
from trajectory_store.storage import Store, StoreConfig


class CoreService:
    """The core as one long-lived process (`python -m engines.train.run --serve`): a step request per
    stdin line; per step, its streaming address (one JSON line) and then its report (the next)."""

    def __init__(self, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
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

    def wait(self) -> dict[str, Any]:
        return self.service.next_line(600, f"the report of step {self.step}")


class CampaignRuntime:
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
    ):
        self.services, self.store, self.config = services, store, dispatch_config
        self.selection, self.packing, self.trainer = selection, packing, trainer
        self.init_model, self.max_policy_lag = init_model, max_policy_lag
        self.trainer_threads, self.seed = trainer_threads, seed
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

    def start_training(self, step: int) -> CoreStep:
        if self.core is None:
            self.core = CoreService(self.trainer_threads)
        root = self.services.policy_root
        request = TrainStepRequest(
            step=step,
            init_model=self.init_model,
            resume_from=f"{root}/checkpoints/step={step - 1}" if step > 0 else None,
            checkpoint_url=f"{root}/checkpoints/step={step}",
            policy_root=root,
            fast_dir=self.services.fast_dir,
            trainer=self.trainer,
            threads=self.trainer_threads,
            seed=self.seed,
            stream=True,
        )
        return self.core.step(request)

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


# -- the scheduler as a process, and its supervisor ------------------------------------------------

log = logging.getLogger("gyre.scheduler")


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
    services: Services  # its tokens are secrets: shown masked, sent in the clear only on the pipe

    def wire(self) -> str:
        """The job as the process reads it (the tokens revealed: stdin only, never argv or disk)."""
        plain = self.model_dump(mode="json")
        plain["services"]["admin_token"] = self.services.admin_token.get_secret_value()
        plain["services"]["engine_admin_token"] = self.services.engine_admin_token.get_secret_value()
        return json.dumps(plain)


def run_controller(
    controller: Controller, runtime: CampaignRuntime, work: list[StepWork], start_version: int = 0
):
    """``controller.run`` in an event loop of its own; what the runtime keeps in that loop (the
    harness zygote) ends with it. Returns the controller's RunReport."""

    async def run():
        try:
            return await controller.run(work, start_version=start_version)
        finally:
            await runtime.aclose()

    return asyncio.run(run())


def write_switch_metrics(store: StoreConfig, step: int, switches: list) -> None:
    """Every switch of a step as metrics rows: its total and each phase, with its cell and what it
    moved (detail: JSON), so `gyre sql` answers "how long did drains take, per cell"."""
    rows: list[tuple[str, float, str | None, str, float]] = []
    for switch in switches:
        detail = json.dumps(switch.detail, sort_keys=True, default=str)
        rows.append((f"switch_to_{switch.to}_s", switch.seconds, switch.cell_id, detail, switch.started))
        for phase, seconds in switch.phases.items():
            rows.append((f"switch_to_{switch.to}_{phase}_s", seconds, switch.cell_id, detail, switch.started))
    write_metric_rows(store, step, rows, f"switches-{step}")


def cell_pool(admin: Admin, engine_urls: list[str], model_dir: str) -> CellPool:
    """A cell per engine (cell-0, the first, is the core), each with a replica of ``model_dir``."""
    engines = {e["url"]: e["engine_id"] for e in admin.gateway("GET", "/admin/stats")["engines"]}
    specs = [CellSpec(f"cell-{i}", url, engines[url], core=i == 0) for i, url in enumerate(engine_urls)]
    return CellPool(admin, specs, model_dir, threads=1)


def _finished_members(store: StoreConfig, step: int, problems: list[dict[str, Any]], group_size: int):
    """(problem id, member) -> Outcome of the step's members the store holds as ended (any attempt
    but an abandoned one)."""
    ledger = step_ledger(store, step)
    finished = {}
    for p in problems:
        for m in range(group_size):
            if (row := ledger.outcome(Problem.from_json(p), m)) is not None:
                reward = float(row.reward or 0.0)
                finished[(p["problem_id"], m)] = Outcome(
                    row.execution_id, row.group_id or "", row.status, reward
                )
    return finished


def schedule_steps(job: ScheduleJob, heartbeat=print) -> int:
    """Runs steps job.start .. job.steps - 1 under the job's policy and commits each; the executions of
    a step that ended before (a restart) are counted, not dispatched again. Returns the last version."""
    services = job.services
    admin = Admin(
        services.gateway_url,
        services.admin_token.get_secret_value(),
        services.engine_admin_token.get_secret_value(),
    )
    if len(services.engine_urls) < 2:
        raise ValueError(
            f"the scheduler needs at least 2 cells (serving.engines); got {len(services.engine_urls)}"
        )
    pool = cell_pool(admin, services.engine_urls, job.policy)
    # A restarted scheduler finds the engines as its predecessor left them: all serve the version
    # the store says is current, and the gateway routes to all of them again.
    serve_version(services, services.engine_urls, job.start, policy_path(services, job.start, job.policy))
    for cell in pool.cells.values():
        admin.gateway("POST", f"/admin/engines/{cell.spec.engine_id}/activate")
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
    )
    work = []
    for step in range(job.start, job.steps):
        problems = choose_problems.fn(job.problems, step)
        finished = _finished_members(job.store, step, problems, job.dispatch.group_size)
        work.append(StepWork(step, problems, job.dispatch.group_size, finished))

    counted = [0]  # switches already counted in a committed step

    def commit(figures: dict[str, Any], report: dict[str, Any]) -> None:
        con = connect(Store(job.store), job.selection)
        try:  # executions by status (abandoned ones too), reward, pass rate, tokens: as a colocate step's
            metrics = step_figures(con, figures["step"])
        finally:
            con.close()
        metrics |= {k: float(v) for k, v in report.get("metrics", {}).items()}
        switches, counted[0] = pool.switches[counted[0] :], len(pool.switches)
        metrics["switches"] = float(len(switches))
        for role in ("train", "rollout"):
            seconds = sorted(s.seconds for s in switches if s.to == role)
            if seconds:
                metrics[f"switch_to_{role}_p50_s"] = seconds[len(seconds) // 2]
        metrics |= {
            "version": float(report["version"]),
            "trained": float(bool(report.get("trained"))),
            "groups_trained": float(figures["groups_trained"]),
            "groups_skipped": float(figures["groups_skipped"]),
            "rollout_s": float(figures["rollout_s"]),
        }
        record = StepRecord(
            step=figures["step"],
            version=int(report["version"]),
            checkpoint_url=report["checkpoint_url"],
            policy_uri=report["policy_uri"],
            metrics=metrics,
            committed_at=time.time(),
        )
        commit_step.fn(job.store, figures["step"], record)
        write_switch_metrics(job.store, figures["step"], switches)
        heartbeat(json.dumps({"committed": figures["step"], "version": record.version, "wall": time.time()}))

    params = {"max_policy_lag": job.max_policy_lag, **job.scheduler.params}
    if job.scheduler.policy == "colocate":
        params = {}
    controller = Controller(
        make_policy(job.scheduler.policy, **params),
        pool,
        runtime,
        sessions_per_cell=job.scheduler.sessions_per_cell,
        on_step=commit,
        on_tick=lambda summary: heartbeat(json.dumps({"heartbeat": {**summary, "wall": time.time()}})),
    )

    try:
        report = run_controller(controller, runtime, work, job.start)
    finally:
        runtime.close()
        pool.close()
    switches = [
        {"cell": s.cell_id, "to": s.to, "s": round(s.seconds, 3), **s.phases} for s in report.switches
    ]
    heartbeat(
        json.dumps(
            {"done": {"version": controller.version, "switches": switches, "errors": controller.errors}}
        )
    )
    return controller.version


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    job = ScheduleJob.model_validate_json(sys.stdin.readline())
    schedule_steps(job, heartbeat=lambda line: print(line, flush=True))
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
    from tasks.campaign import last_committed

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
