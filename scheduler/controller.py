"""The controller: runs steps of a campaign on real cells under a scheduling policy.

Every tick (a quarter second) it builds a `SchedulerState` from what is true (cell roles, executions
dispatched and finished per step, groups finished, the trained policy version), asks the policy
(scheduler/policy.py: the same code the simulator drives) for a `Decision`, switches the cells it
names (scheduler/cells.py: drain -> sleep -> join, or leave -> wake -> register) and starts the
executions it asks for. Training streams: each finished group is packed and appended to the step
being trained as soon as the core cell trains (engines/train/stream.py), whichever replicas have
joined take its micro-batches, and the step closes when its last group is in. The core publishes the
new version, the engines that serve swap to it, and the next step opens at once.

Nothing here knows about Prefect, problems or storage: a `Runtime` (tasks/steps.py CampaignSteps) runs one
execution, packs one group, starts the core's training process and swaps engine weights. Each step
the core trains ends as a `StepDone` (with the core's TrainStepReport) handed to ``on_step``, which
commits it (scheduler/service.py).

    controller = Controller(policy, pool, runtime, sessions_per_cell=2)
    report = asyncio.run(controller.run([StepWork(0, problems, group_size=4), ...], start_version=0))
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines.train.run import TrainStepReport
from scheduler.cells import CellPool
from scheduler.policy import CellState, Policy, SchedulerState, StepProgress
from scheduler.report import Outcome, RunReport, StepDone, cpu_busy, cpu_times
from trajectory_store.step import add_counts

TICK_S = 0.25


@dataclass(frozen=True)
class Chunk:
    """A packed group, written where replicas can read it (``uri`` None: nothing in it is trained, a
    zero-signal group or one with nothing trainable), and its counts (trajectory_store/step.py
    step_batch's: trained, packed, left out by reason, tokens), summed into its step's figures."""

    uri: str | None
    sequences: int
    executions: int
    figures: dict[str, float] = field(default_factory=dict)


class Training(Protocol):
    """The core's streaming step (a process of its own)."""

    def address(self) -> tuple[str, int, int]: ...  # blocks until the step is open

    def append(self, chunk: Chunk, key: str) -> None: ...

    def close(self) -> None: ...

    def wait(self) -> TrainStepReport: ...  # what the core did: the version it made, its metrics


class Runtime(Protocol):
    async def execute(self, step: int, problem: dict[str, Any], member: int) -> Outcome: ...

    def pack_group(self, step: int, problem: dict[str, Any]) -> Chunk: ...

    def prepare(self, step: int) -> float: ...  # the core up and at `step`: its start-up seconds

    def start_training(self, step: int) -> Training: ...

    def serve(self, engine_urls: list[str], version: int) -> None: ...  # awake engines swap weights

    def weights_path(self, version: int) -> str: ...


@dataclass
class StepWork:
    """One step's executions: `group_size` members of every problem (a problem's dict carries its
    `problem_id`). `finished` (problem id, member) -> Outcome: members that ended before (a resumed
    step): they count as finished and are never dispatched again."""

    step: int
    problems: list[dict[str, Any]]
    group_size: int
    finished: dict[tuple[str, int], Outcome] = field(default_factory=dict)

    def members(self) -> list[tuple[dict[str, Any], int]]:
        return [
            (p, m)
            for p in self.problems
            for m in range(self.group_size)
            if (p["problem_id"], m) not in self.finished
        ]


@dataclass
class _Step:
    work: StepWork
    queue: list[tuple[dict[str, Any], int]]
    dispatched: int = 0
    finished: int = 0
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)  # problem id -> outcomes
    ready_groups: list[dict[str, Any]] = field(default_factory=list)  # problems whose group finished
    packed: list[tuple[Chunk, str]] = field(default_factory=list)  # packed groups the core has not taken
    appended: int = 0
    skipped: int = 0
    figures: dict[str, float] = field(default_factory=dict)  # its groups' packing counts, summed
    training: Training | None = None
    closed: bool = False
    behaviour_versions: list[int] = field(default_factory=list)  # of unfinished executions
    started_at: float | None = None  # its first dispatch
    rolled_out_at: float | None = None

    @property
    def executions(self) -> int:
        return len(self.work.problems) * self.work.group_size

    @property
    def groups_done(self) -> int:
        return sum(len(v) == self.work.group_size for v in self.outcomes.values())


class Controller:
    def __init__(
        self,
        policy: Policy,
        pool: CellPool,
        runtime: Runtime,
        *,
        sessions_per_cell: int,
        tick_s: float = TICK_S,
        on_step: Callable[[StepDone, TrainStepReport], None] | None = None,
        on_tick: Callable[[dict[str, Any]], None] | None = None,
    ):
        """`on_step(the step, the core's report)` runs once a step's version is published (a campaign
        commits it there); `on_tick(summary)` every tick (a heartbeat)."""
        if sum(c.spec.core for c in pool.cells.values()) != 1:
            raise ValueError("the controller needs a pool with exactly one core cell (it trains every step)")
        self.policy, self.pool, self.runtime = policy, pool, runtime
        self.sessions_per_cell, self.tick_s = sessions_per_cell, tick_s
        self.on_step, self.on_tick = on_step, on_tick
        self.switching: dict[str, asyncio.Task] = {}
        self.moving_to: dict[str, str] = {}
        self.errors: list[str] = []
        self.moves_counted = 0  # the pool's moves (cells started again on another host) in a StepDone
        self.timeline: list[tuple[float, str, str]] = []
        self.outcomes: list[Outcome] = []
        self.running: set[asyncio.Task] = set()
        self.decisions = 0

    async def run(self, work: Sequence[StepWork], start_version: int = 0) -> RunReport:
        """Runs `work` (consecutive steps, the first trains `start_version`) to its last update. The
        core starts first, before the clock and the first dispatch: its start-up shares the core
        cell's hardware, which serves rollout meanwhile under colocate and a lent core, and a
        campaign pays it once (`RunReport.core_start_s`), as it pays the cells' start."""
        steps = [_Step(w, w.members()) for w in work]
        self.version = start_version
        core_start_s = await self._prepare(steps)
        self.pool.restart_clock()
        cpu = cpu_times()
        started = time.monotonic()
        self._wall = time.time() - started  # monotonic -> wall clock
        for step in steps:
            for (problem_id, _), outcome in sorted(step.work.finished.items()):
                problem = next(p for p in step.work.problems if p["problem_id"] == problem_id)
                step.dispatched += 1
                self._finished(step, problem, outcome)
        self.reports: list[StepDone] = []
        for cell in self.pool.cells.values():
            self.timeline.append((0.0, cell.spec.cell_id, cell.role))
        trainer = asyncio.create_task(self._train(steps, started))
        while not trainer.done():
            self.current = steps[min(len(self.reports), len(steps) - 1)]
            state = self._state(steps)
            for cell_id in self.pool.take_moved():  # a cell started again on another host serves
                self.timeline.append((self.pool.now(), cell_id, "rollout"))
                await self._serve_moved(cell_id)
            decision = self.policy.decide(state)
            self.decisions += 1
            for cell_id, role in decision.roles.items():
                if cell_id not in self.switching and cell_id not in self.pool.lost:
                    self.moving_to[cell_id] = role
                    self.switching[cell_id] = asyncio.create_task(self._switch(cell_id, role))
            for order in decision.dispatch:
                step = next(s for s in steps if s.work.step == order.step)
                for _ in range(min(order.executions, len(step.queue))):
                    self._dispatch(step)
            if self.on_tick is not None:
                self.on_tick(self._summary(steps))
            await asyncio.wait([trainer], timeout=self.tick_s)
        trainer.result()  # a training failure ends the run with its error
        for task in list(self.switching.values()):
            await task
        makespan_s = time.monotonic() - started
        await self._leave_serving()
        return RunReport(
            makespan_s=makespan_s,
            steps=self.reports,
            switches=list(self.pool.switches),
            timeline=self.timeline,
            decisions=self.decisions,
            outcomes=self.outcomes,
            cpu_busy=cpu_busy(cpu, cpu_times()),
            core_start_s=core_start_s,
        )

    async def _leave_serving(self) -> None:
        """Every cell that ended in training wakes on the last version, after the makespan: the
        campaign's held-out evaluation and a scheduler started again find every engine serving (under
        colocate the last step's training leaves them all asleep)."""
        asleep = [
            c.cell_id for c in self.pool.states() if c.role == "train" and c.cell_id not in self.pool.lost
        ]
        await asyncio.gather(*(self._switch(cell_id, "rollout") for cell_id in asleep))

    async def _prepare(self, steps: list[_Step]) -> float:
        """The core started and at the first step (Runtime.prepare), a heartbeat every tick meanwhile."""
        if not steps:
            return 0.0
        prepare = asyncio.ensure_future(asyncio.to_thread(self.runtime.prepare, steps[0].work.step))
        while not prepare.done():
            if self.on_tick is not None:
                self.on_tick({**self._summary(steps), "preparing": "core"})
            await asyncio.wait([prepare], timeout=self.tick_s)
        return prepare.result()

    async def _train(self, steps: list[_Step], started: float) -> None:
        """The steps' training, one after the other: open (the core's step), append finished groups
        while the core cell trains, close when the last group is in, publish, serve the new version."""
        for step in steps:
            step.training = await asyncio.to_thread(self.runtime.start_training, step.work.step)
            await asyncio.to_thread(step.training.address)
            await self._rejoin(step)
            while not self._complete(step):
                await self._append_ready(step)
                await asyncio.sleep(self.tick_s / 5)
            step.closed = True
            await asyncio.to_thread(step.training.close)
            report = await asyncio.to_thread(step.training.wait)
            self.reports.append(self._step_done(step, report, started))
            if self.on_step is not None:
                await asyncio.to_thread(self.on_step, self.reports[-1], report)
            # Executions are dispatched at self.version: it moves once the awake engines serve the new
            # version. Before 2026-12-07 it moved first, and the executions dispatched while the
            # engines loaded it (seconds; more on hosts, from object storage) ran on the old one: left
            # out as stale at max_policy_lag 0. A cell woken meanwhile (at the old one) is served next.
            await self._serve_new_version(report.version)
            self.version = report.version
            await self._serve_new_version(report.version)

    # -- executions ----------------------------------------------------------------------------

    def _dispatch(self, step: _Step) -> None:
        problem, member = step.queue.pop(0)
        step.dispatched += 1
        step.behaviour_versions.append(self.version)
        step.started_at = step.started_at or time.monotonic()
        task = asyncio.create_task(self._execute(step, problem, member, self.version))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _execute(self, step: _Step, problem: dict[str, Any], member: int, version: int) -> None:
        try:
            outcome = await self.runtime.execute(step.work.step, problem, member)
        except Exception as error:  # counted as an execution that ended in error; the step goes on
            outcome = Outcome(f"s{step.work.step}-{problem['problem_id']}-g{member}", "", "error", 0.0)
            self.errors.append(f"{outcome.execution_id}: {type(error).__name__}: {error}")
        step.behaviour_versions.remove(version)
        self._finished(step, problem, outcome)

    def _finished(self, step: _Step, problem: dict[str, Any], outcome: Outcome) -> None:
        step.finished += 1
        self.outcomes.append(outcome)
        group = step.outcomes.setdefault(problem["problem_id"], [])
        group.append(outcome)
        if len(group) == step.work.group_size:
            step.ready_groups.append(problem)
        if step.finished == step.executions:
            step.rolled_out_at = time.monotonic()

    def _summary(self, steps: list[_Step]) -> dict[str, Any]:
        return {
            "t": round(self.pool.now(), 2),
            "version": self.version,
            "dispatched": sum(s.dispatched for s in steps),
            "finished": sum(s.finished for s in steps),
            "roles": {c.spec.cell_id: c.role for c in self.pool.cells.values()},
            "switching": sorted(self.switching),
            "errors": len(self.errors),
        }

    # -- training ------------------------------------------------------------------------------

    def _core_trains(self) -> bool:
        return any(c.spec.core and c.role == "train" for c in self.pool.cells.values()) and not any(
            c.spec.core for c in self.pool.cells.values() if c.spec.cell_id in self.switching
        )

    async def _append_ready(self, step: _Step) -> None:
        """Finished groups are packed as they finish (the controller's work, whatever the core
        does), and go to the step being trained while the core cell trains (colocate and a lent core
        hold them until the core turns to training)."""
        while step.ready_groups:
            problem = step.ready_groups.pop(0)
            chunk = await asyncio.to_thread(self.runtime.pack_group, step.work.step, problem)
            step.figures = add_counts(step.figures, chunk.figures)
            if chunk.uri is None:
                step.skipped += 1
            else:
                step.packed.append((chunk, problem["problem_id"]))
        while step.packed and self._core_trains():
            chunk, problem_id = step.packed.pop(0)
            await asyncio.to_thread(step.training.append, chunk, problem_id)
            step.appended += 1

    def _complete(self, step: _Step) -> bool:
        return step.appended + step.skipped == len(step.work.problems)

    async def _rejoin(self, step: _Step) -> None:
        """Train cells whose replica ended the last step join the new one."""
        address = step.training.address()
        for cell in self.pool.cells.values():
            if cell.role == "train" and cell.replica and not cell.replica.busy:
                cell.replica.poll()
                if cell.spec.cell_id not in self.switching:
                    await asyncio.to_thread(cell.replica.join, *address)

    async def _serve_moved(self, cell_id: str) -> None:
        """The current version served by a cell that moved host (it started with the one it was told)."""
        try:
            await asyncio.to_thread(
                self.runtime.serve, [self.pool.cells[cell_id].spec.engine_url], self.version
            )
        except Exception as error:  # it serves what it loaded; the run goes on and reports it
            self.errors.append(
                f"serving v{self.version} on moved cell {cell_id}: {type(error).__name__}: {error}"
            )

    async def _serve_new_version(self, version: int) -> None:
        awake = [
            c.spec.engine_url
            for c in self.pool.cells.values()
            if c.role == "rollout" and c.spec.cell_id not in self.switching.keys() | self.pool.lost
        ]
        try:
            if awake:
                await asyncio.to_thread(self.runtime.serve, awake, version)
        except Exception as error:  # none answered (lost before the gateway held them dead): the
            # run goes on; a cell back to rollout wakes at self.version, a moved one is served it
            self.errors.append(f"serving v{version} on {awake}: {type(error).__name__}: {error}")
        for cell in self.pool.cells.values():
            if cell.replica and cell.replica.busy:
                await asyncio.to_thread(_drain_result, cell.replica)

    # -- cells ---------------------------------------------------------------------------------

    async def _switch(self, cell_id: str, role: str) -> None:
        try:
            if role == "train":
                training = self.current.training
                address = training.address() if training is not None and not self.current.closed else None
                await asyncio.to_thread(self.pool.to_train, cell_id, address)
                cell, step = self.pool.cells[cell_id], self.current
                if cell.replica and not cell.replica.busy and step.training and not step.closed:
                    await asyncio.to_thread(cell.replica.join, *step.training.address())  # a newer step
            else:
                version = self.version
                path = self.runtime.weights_path(version)
                await asyncio.to_thread(self.pool.to_rollout, cell_id, version, path)
                if self.version != version:  # a newer one was served while it woke
                    await asyncio.to_thread(
                        self.runtime.serve, [self.pool.cells[cell_id].spec.engine_url], self.version
                    )
            self.timeline.append((self.pool.now(), cell_id, role))
        except Exception as error:  # the cell keeps its old role; the run goes on and reports it
            self.errors.append(f"switch of {cell_id} to {role}: {type(error).__name__}: {error}")
        finally:
            self.switching.pop(cell_id, None)
            self.moving_to.pop(cell_id, None)

    def _state(self, steps: list[_Step]) -> SchedulerState:
        cells = tuple(
            CellState(
                cell_id=c.cell_id,
                role=self.moving_to.get(c.cell_id, c.role),  # a switching cell: the role it moves into
                core=c.core,
                phase=(
                    "switching"
                    if c.cell_id in self.switching
                    else "lost"
                    if c.cell_id in self.pool.lost
                    else "ready"
                ),
                since=c.since,
                active_sessions=c.active_sessions,
            )
            for c in self.pool.states()
        )
        untrained = [s for s in steps if not s.closed]
        unfinished = [v for s in untrained for v in s.behaviour_versions]
        return SchedulerState(
            now=self.pool.now(),
            cells=cells,
            sessions_per_cell=self.sessions_per_cell,
            dispatched=sum(s.dispatched for s in steps),
            finished=sum(s.finished for s in steps),
            steps=tuple(
                StepProgress(s.work.step, s.executions, s.dispatched, s.groups_done, s.finished)
                for s in untrained
            ),
            policy_version=self.version,
            oldest_behaviour_version=min(unfinished) if unfinished else None,
            train_backlog_s=0.0,
        )

    def _step_done(self, step: _Step, report: TrainStepReport, started: float) -> StepDone:
        now = time.monotonic()
        rolled_out = step.rolled_out_at or now
        began = min(step.started_at or rolled_out, rolled_out)  # every member ended before: no rollout
        return StepDone(
            step=step.work.step,
            version=report.version,
            executions=step.executions,
            groups_trained=step.appended,
            groups_skipped=step.skipped,
            rollout_s=round(rolled_out - began, 2),
            rolled_out_s=round(rolled_out - started, 2),
            ended_s=round(now - started, 2),
            started_at=self._wall + began,
            rolled_out_at=self._wall + rolled_out,
            ended_at=self._wall + now,
            metrics=dict(report.metrics),
            figures=dict(step.figures) | {"cells_moved": float(self._new_moves())},
        )

    def _new_moves(self) -> int:
        """Cells that moved host since the last step ended (their version served by then)."""
        new, self.moves_counted = len(self.pool.moves) - self.moves_counted, len(self.pool.moves)
        return new


def _drain_result(replica) -> None:
    """A replica in a step that just ended returns on its own; collect its result."""
    deadline = time.monotonic() + 30
    while replica.busy and time.monotonic() < deadline:
        if replica.poll() is None:
            time.sleep(0.05)
