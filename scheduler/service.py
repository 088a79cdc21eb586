"""The scheduler's service loop: the steps of a campaign run on cells under a policy, each one
committed as its version is published, a heartbeat line every tick.

    config = SchedulerConfig(policy="elastic", params={"depth": 2})
    version = schedule_steps(campaign, pool, config, start=0, steps=4, max_policy_lag=1, heartbeat=print)

The loop knows nothing of Prefect, problems or the store: the campaign's pieces come in as a
`Campaign` (tasks/steps.py's CampaignSteps implements it): run one execution, pack one group,
start a training step, serve a version (scheduler.controller.Runtime), and the two the loop adds:
a step's work (its problems and the members that ended before a restart) and the commit of a step.
tasks/schedule.py starts this loop in a process of its own (``python -m tasks.schedule``) and
supervises it (heartbeats, restarts from the store); what the loop says on ``heartbeat`` is one
scheduler.report.Message a line (JSON), which the flow parses with ``Message.parse``:

    {"heartbeat": {t, version, dispatched, finished, roles, switching, errors, wall}}   every tick
    {"committed": {step, version, wall}}                                               every step
    {"done": {version, switches, errors}}                                              at the end
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from engines.admin import AdminClient
from engines.devices import CellDevices
from engines.devices.cpu_quota import CpuPartition
from engines.train.run import TrainStepReport
from scheduler.cells import CellPool, CellSpec, Switch
from scheduler.config import SchedulerConfig
from scheduler.controller import Controller, Runtime, StepWork
from scheduler.policy import make_policy
from scheduler.remote import RemoteReplica
from scheduler.report import Committed, Done, Heartbeat, Message, RunReport, StepDone


class Campaign(Runtime, Protocol):
    """A campaign's pieces, as the loop uses them (tasks/steps.py CampaignSteps): a Runtime (one
    execution, one group packed, a training step, a version served) and

    - ``step_work(step)``: its problems, and the members that ended before (a restart) as finished;
    - ``commit(done, report, switches)``: commits the step (what the core did, the step's figures, the
      switches since the last commit) and returns the version committed;
    - ``aclose()`` in the loop's event loop (the harness zygote), ``close()`` after it (the core)."""

    def step_work(self, step: int) -> StepWork: ...

    def commit(self, done: StepDone, report: TrainStepReport, switches: list[Switch]) -> int: ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...


def cell_pool(
    admin: AdminClient,
    engine_urls: list[str],
    model_dir: str,
    cells: list[CellDevices] | None = None,
    partition: CpuPartition | None = None,
    loss: dict | None = None,
    on_hosts: bool = False,
) -> CellPool:
    """A cell per engine (cell-0, the first, is the core), each with a replica of ``model_dir`` that
    takes the core's ``loss`` (LossConfig fields); ``cells``: each cell's devices (its replica's GPUs,
    cores, threads and CPU cgroup; None: one thread each); ``partition``: the cells' CPU cgroups
    (stack/stack.py LocalStack.partition). ``on_hosts``: the cells run on hosts of [cluster], each
    with its replica beside its engine (the gateway lists its ``trainer_url``: scheduler/remote.py)."""
    views = {e.url: e for e in admin.gateway_stats().engines}
    specs = [
        CellSpec(f"cell-{i}", url, views[url].engine_id, core=i == 0) for i, url in enumerate(engine_urls)
    ]
    replicas = None
    if on_hosts:
        missing = [s.cell_id for s in specs if not s.core and not views[s.engine_url].trainer_url]
        if missing:
            raise RuntimeError(
                f"cells {missing} serve no trainer replica (the gateway lists no trainer_url for their "
                "engines): their flow runs were started without one (CellOrder.replica)"
            )
        replicas = {
            s.cell_id: RemoteReplica(views[s.engine_url].trainer_url, admin.engine_token, loss)
            for s in specs
            if not s.core
        }
    return CellPool.behind_gateway(
        admin,
        specs,
        model_dir,
        threads=1,
        loss=loss,
        cells=cells,
        partition=partition,
        replicas=replicas,
        remote=(lambda url: RemoteReplica(url, admin.engine_token, loss)) if on_hosts else None,
    )


def run_controller(
    controller: Controller, campaign: Campaign, work: list[StepWork], start_version: int = 0
) -> RunReport:
    """``controller.run`` in an event loop of its own; what ``campaign`` keeps in that loop (its
    ``aclose``: the harness zygote) ends with it."""

    async def run() -> RunReport:
        try:
            return await controller.run(work, start_version=start_version)
        finally:
            await campaign.aclose()

    return asyncio.run(run())


def schedule_steps(
    campaign: Campaign,
    pool: CellPool,
    config: SchedulerConfig,
    *,
    start: int,
    steps: int,
    max_policy_lag: int,
    heartbeat: Callable[[str], None] = print,
) -> int:
    """Runs steps ``start`` .. ``steps - 1`` under ``config``'s policy and commits each; the executions
    of a step that ended before (a restart) are counted, not dispatched again. Returns the last
    version. ``campaign`` and ``pool`` are closed when it ends."""
    # A restarted scheduler finds the engines as its predecessor left them: all serve the version
    # the store says is current, and the gateway routes to all of them again.
    campaign.serve([cell.spec.engine_url for cell in pool.cells.values()], start)
    for cell in pool.cells.values():
        cell.engine.register()
    work = [campaign.step_work(step) for step in range(start, steps)]

    counted = 0  # switches already counted in a committed step

    def commit(done: StepDone, report: TrainStepReport) -> None:
        nonlocal counted
        switches, counted = pool.switches[counted:], len(pool.switches)
        version = campaign.commit(done, report, switches)
        heartbeat(Message(committed=Committed(step=done.step, version=version, wall=time.time())).line())

    params = {"max_policy_lag": max_policy_lag, **config.params}
    if config.policy == "colocate":
        params = {}
    controller = Controller(
        make_policy(config.policy, **params),
        pool,
        campaign,
        sessions_per_cell=config.sessions_per_cell,
        on_step=commit,
        on_tick=lambda summary: heartbeat(Message(heartbeat=Heartbeat(**summary, wall=time.time())).line()),
    )
    try:
        report = run_controller(controller, campaign, work, start)
    finally:
        campaign.close()
        pool.close()
    switches = [
        {"cell": s.cell_id, "to": s.to, "s": round(s.seconds, 3), **s.phases} for s in report.switches
    ]
    heartbeat(
        Message(done=Done(version=controller.version, switches=switches, errors=controller.errors)).line()
    )
    return controller.version
