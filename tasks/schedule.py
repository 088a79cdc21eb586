"""The scheduler service of a campaign: the process that runs the scheduler's loop
(scheduler/service.py) on the campaign's pieces (tasks/steps.py CampaignSteps: the step recipe the
step flow calls too), and the Prefect task that supervises it.

    python -m tasks.schedule < job.json     # a ScheduleJob on stdin: the steps from job.start on,
                                            # a scheduler.report.Message a line: a heartbeat every
                                            # tick, each step committed, done at the end
    run_scheduler(job, last_step, on_line)  # the campaign's long-running task: starts that process,
                                            # restarts it from the store if it dies or goes silent
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
from collections.abc import Callable
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from engines.admin import AdminClient
from engines.devices import CellDevices
from engines.devices.cpu_quota import cell_quota
from scheduler.report import Message
from scheduler.service import SchedulerConfig, cell_pool, schedule_steps
from stack.campaign import Services
from tasks.commit import last_committed, write_metrics
from tasks.steps import CampaignSteps, StepsConfig

__all__ = ["Message", "ScheduleJob", "SchedulerConfig", "run_scheduler"]


# -- the scheduler as a process, and its supervisor ------------------------------------------------

log = logging.getLogger("gyre.scheduler")


class ScheduleJob(StepsConfig):
    """Everything the scheduler process needs, as JSON on its stdin (admin tokens included: never in
    argv or on disk): the step recipe's sections, the scheduler's, the steps to run and the services."""

    scheduler: SchedulerConfig
    steps: int
    start: int
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
    loss = job.trainer.loss.model_dump()
    quota = contextlib.ExitStack()
    trainer_cell = None
    if services.cells_on_hosts:  # each cell's engine and replica on its host (their live URLs)
        pool = cell_pool(admin, cells_by_id(admin), job.policy, loss=loss, on_hosts=True)
        if services.core_cpus:  # the core trains under the quota each cell has on its host
            core = quota.enter_context(cell_quota("cell-0", services.core_cpus))
            [trainer_cell] = core.place([CellDevices(threads=serving.trainer_threads)], ["cell-0"])
    else:
        # a running `gyre up` stack may have other engines than this config names: then no cell is placed
        placed = len(services.engine_urls) == serving.engines
        cells = (
            [services.in_cell(serving.engine_cell(i), i) for i in range(serving.engines)] if placed else None
        )
        pool = cell_pool(admin, services.engine_urls, job.policy, cells, loss=loss)
        trainer_cell = services.in_cell(serving.trainer_cell(), 0) if placed else None
    recipe = StepsConfig.model_validate(job.model_dump(include=set(StepsConfig.model_fields)))
    runtime = CampaignSteps(recipe, services, trainer_cell=trainer_cell)
    with quota:
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


def cells_by_id(admin: AdminClient) -> list[str]:
    """The engine URLs of the gateway's live cells on hosts, cell-0 first: where each cell serves now
    (a cell started again on another host has a new URL, under its id)."""
    live = [e for e in admin.gateway_stats().engines if e.state != "dead"]
    return [e.url for e in sorted(live, key=lambda e: int(e.engine_id.rsplit("-", 1)[-1]))]


class SchedulerDied(RuntimeError):
    pass


OnLine = Callable[[Message, int], None]


def _watch(job: ScheduleJob, on_line: OnLine, argv: list[str] | None = None) -> int:
    """One scheduler process, from start to exit: its messages go to `on_line` (a line that is not
    one is logged and passed over; any line counts as a sign of life); killed (with every
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
            try:
                message = Message.parse(line)
            except ValueError as error:
                log.warning("the scheduler (pid %d) said %s", process.pid, error)
                return
            on_line(message, process.pid)

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
def run_scheduler(job: ScheduleJob, last_step: int, on_line: OnLine | None = None) -> dict[str, Any]:
    """The campaign's scheduler service: a process that runs the steps, supervised. A scheduler that
    exits with an error, is killed, or goes silent (no heartbeat for heartbeat_timeout_s) is killed
    with everything it started and started again from the store: after the last committed step, with
    the executions that ended counted, not dispatched again. Restarts are counted in the metrics."""
    restarts: list[dict[str, Any]] = []
    done: dict[str, Any] = {}

    def seen(message: Message, pid: int) -> None:
        if message.done is not None:
            done.update(message.done.model_dump())
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
