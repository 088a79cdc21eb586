"""Cells: the units of hardware that move between rollout and training, and the two switch sequences.

A cell on this machine is a rollout engine process and a trainer replica process, each with the cell's
thread budget; the one that is not in the cell's role sleeps (an engine asleep holds no weights and
no KV; a replica between steps holds only its model skeleton). Neither process is started or stopped
by a switch, so a switch costs a drain, a sleep and a weight pull, not a start-up. On a GPU the same
sequence moves weights between device and host (bench/gpu/role_switch.py times this sequence there,
on cells whose engine and trainer live in its own process).

    pool = CellPool.behind_gateway(admin, [CellSpec("cell-0", url0, "rollout-8001", core=True), ...], model_dir)
    pool.to_train("cell-1", (host, port, step))   # drain -> sleep -> join   (Switch, timed per phase)
    pool.to_rollout("cell-1", version, path)      # leave -> wake -> register

A switch drives a cell's two ends: its engine (`EngineEnd`: drain, sleep, wake, register; on this
machine `GatewayEngine`, the gateway's and the engine's admin endpoints) and its trainer (`TrainerEnd`:
join, leave; on this machine a `Replica` process). The sequence and its timing are the pool's alone.

rollout -> train: the gateway drains the cell's engine (every live session moves to an engine that
stays, with its KV cache and any request in flight: engines/gateway/router.py, so no execution is
interrupted), the engine sleeps, and the replica pulls the step's weights from the core and joins the
step in progress (engines/train/elastic.py). The core cell has no replica: the core trains in every
step; its engine only serves while the whole pool rolls out (colocate).

train -> rollout: the replica leaves after its current micro-batch (its gradient sum is handed to the
core, so nothing it computed is lost), the engine wakes with the newest published weights, and the
gateway routes new sessions to it again.

A cell owns its share of the hardware: on a GPU its devices; on CPU, with `[serving] partition =
"cgroup"`, a CPU cgroup with its share as quota (engines/devices/cpu_quota.py). The quota belongs to
the cell, not to a process: the engine and the replica of a cell (and the core trainer for the core
cell) are all in the cell's cgroup, so a switch moves nothing. The end that sleeps uses none of the
share and the end that works may use all of it; an idle cell's share is lost to the others, as an
idle GPU is. ``pool.partition.usage_s()`` is each cell's CPU use.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from engines.admin import AdminClient, DrainReport
from engines.devices import CellDevices, process_env
from engines.devices import settings as devices
from engines.devices.cpu_quota import CpuPartition
from engines.train.satellite import run_satellite
from scheduler.policy import CellState, Role

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 120.0  # a replica that has not joined by then has failed (start-up is seconds)


@dataclass(frozen=True)
class CellSpec:
    cell_id: str
    engine_url: str
    engine_id: str  # the engine's id in the gateway
    core: bool = False


@dataclass
class Switch:
    """One role change of one cell, timed per phase (seconds)."""

    cell_id: str
    to: Role
    started: float  # time.time() when it began
    phases: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())


# -- what the controller and a replica process say to each other (through multiprocessing queues) ----


@dataclass(frozen=True)
class Join:
    """Join the step whose core listens at host:port (with ``loss``, the core's LossConfig fields)."""

    host: str
    port: int
    step: int
    loss: dict | None = None


@dataclass(frozen=True)
class Stop:
    """End the replica process."""


@dataclass(frozen=True)
class Ready:
    """The replica's model is built; what its process got (engines/devices DevicesReport)."""

    devices: dict


@dataclass(frozen=True)
class Joined:
    """The replica counts in the step (engines/train/satellite.py's join info)."""

    info: dict


@dataclass(frozen=True)
class Left:
    """The replica left its step or the step ended: its result (micro-batches, handoff, an error)."""

    result: dict


ReplicaCommand = Join | Stop
ReplicaEvent = Ready | Joined | Left


def replica_main(
    model_dir: str, env: dict[str, str], loss: dict, commands, events, leave, address: str | None = None
) -> None:
    """A cell's trainer replica: takes its cell's devices (``env``: engines/devices.py process_env),
    builds the model once, then joins the steps it is sent to (``address``: its host's on the cluster
    network, where it takes part in the step's gloo reduction; None: torch's default, this machine).

    commands: `Join` or `Stop`; events: `Ready` once built, `Joined` once it counts in the step, then
    `Left` when it left or the step ended; ``leave`` (an Event) asks it to leave after its current
    micro-batch."""
    devices.enter_cell(env)  # before torch touches a GPU or starts threads
    import torch

    from engines.model.weights import load_model
    from engines.train.config import LossConfig
    from engines.train.run import elastic_at
    from engines.train.stream import read_batch
    from engines.train.worker import GradWorker

    worker = GradWorker(load_model(model_dir, dtype=torch.float32), LossConfig(**loss))
    events.put(Ready(devices.report().model_dump()))
    while True:
        command: ReplicaCommand = commands.get()
        if isinstance(command, Stop):
            return
        if command.loss is not None:  # the core's loss, so the replica's gradients are the core's
            worker.loss_config = LossConfig(**command.loss)
        try:
            result = run_satellite(
                command.host,
                command.port,
                command.step,
                worker,
                read_batch,
                leave=leave.is_set,
                joined=lambda info: events.put(Joined(info)),
                config=elastic_at(address or "127.0.0.1"),
            )
        except Exception as error:  # the step failed for this replica; the core redoes its share
            result = {"error": f"{type(error).__name__}: {error}"}
        events.put(Left(result))


class Replica:
    """The handle of one replica process (spawned once, reused by every switch of its cell)."""

    def __init__(
        self,
        model_dir: str,
        threads: int,
        loss: dict | None = None,
        cell: CellDevices | None = None,
        address: str | None = None,
    ):
        """``cell``: its cell's GPUs, cores and CPU cgroup (``threads`` threads, or the cell's when given):
        the process joins the cell's cgroup as it starts (engines/devices/settings.enter_cell).
        ``address``: its host's on the cluster network (a cell on another host than the core's)."""
        context = multiprocessing.get_context("spawn")
        self.commands, self.events, self.leave = context.Queue(), context.Queue(), context.Event()
        env = process_env(cell or CellDevices(threads=threads))
        self.loss = loss  # sent with every join: a replica's loss is the core's
        self.process = context.Process(
            target=replica_main,
            args=(model_dir, env, loss or {}, self.commands, self.events, self.leave, address),
            daemon=True,
        )
        self.process.start()
        self.busy = False
        self.last_result: dict | None = None
        self.devices: dict | None = None  # what its process got (DevicesReport), once ready
        # One thread reads the replica's events and keeps the state below; callers wait on it. Before
        # 2026-12-06 each caller read the queue itself, and the controller's collection of a step's
        # result (poll) could take the `Left` a switch to rollout (leave_step) was waiting for: that
        # switch then failed after 60 s with the replica idle.
        self._cond = threading.Condition()
        self._ready = False
        self._joined: dict | None = None
        self._done: dict | None = None  # a step's result nobody has collected yet
        threading.Thread(target=self._read, daemon=True, name="replica-events").start()

    def _read(self) -> None:
        while True:
            try:
                event: ReplicaEvent = self.events.get(timeout=0.5)
            except queue.Empty:
                if self.process.is_alive():
                    continue
                with self._cond:  # waiters see the death now rather than at their timeout
                    self._cond.notify_all()
                return
            except (EOFError, OSError, ValueError):  # the queue closed with the process
                return
            with self._cond:
                match event:
                    case Ready(devices=got):
                        self.devices, self._ready = got, True
                    case Joined(info=info):
                        self._joined = info
                    case Left(result=result):
                        self.busy, self.last_result, self._done = False, result, result
                self._cond.notify_all()

    def _wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until ``done()`` (called under the lock), or raises when the process ends or stays silent."""
        with self._cond:
            self._cond.wait_for(lambda: done() or not self.process.is_alive(), timeout_s)
            if done():
                return
        if not self.process.is_alive():
            raise RuntimeError(f"the replica's process ended (exit {self.process.exitcode}) {what}")
        raise TimeoutError(f"replica silent for {timeout_s:.0f} s {what}; its process is alive")

    def wait_ready(self, timeout_s: float = JOIN_TIMEOUT_S) -> None:
        self._wait(lambda: self._ready, timeout_s, "while starting")

    def join(
        self, host: str, port: int, step: int, timeout_s: float = JOIN_TIMEOUT_S, loss: dict | None = None
    ) -> dict:
        """Joins the step (``loss``: the core's, else the one it was started with); the join info, or
        ``late`` with the step's result when it ended (or refused it) before the replica counted."""
        with self._cond:
            self.leave.clear()
            self._joined, self._done, self.busy = None, None, True
        self.commands.put(Join(host, port, step, loss if loss is not None else self.loss))
        self._wait(lambda: self._joined is not None or not self.busy, timeout_s, f"joining step {step}")
        with self._cond:
            if self._joined is not None:
                return self._joined
            done, self._done = self._done or self.last_result or {}, None
            return {"late": True, **done}  # the step ended (or refused it) before it could count

    def leave_step(self, timeout_s: float = 60.0) -> dict:
        """Asks the replica to leave after its current micro-batch; its result (handoff timing). A
        step that ended meanwhile, its result collected or not, counts as left."""
        with self._cond:
            if not self.busy:
                done, self._done = self._done, None
                return done if done is not None else {"idle": True}
            self.leave.set()
        self._wait(lambda: not self.busy, timeout_s, "leaving its step")
        with self._cond:
            self._done = None
            return self.last_result or {}

    def poll(self) -> dict | None:
        """The result of a step the replica finished on its own (the step closed), once; None if none."""
        with self._cond:
            done, self._done = self._done, None
            return done

    def stop(self) -> None:
        if self.process.is_alive():
            self.leave.set()
            self.commands.put(Stop())
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


class EngineEnd(Protocol):
    """A cell's rollout engine, as a switch drives it."""

    def drain(self) -> DrainReport: ...  # its live sessions move to engines that stay

    def sleep(self) -> None: ...  # weights and KV freed

    def wake(self, version: int, weights_path: str) -> None: ...

    def register(self) -> None: ...  # new sessions are routed to it again


class TrainerEnd(Protocol):
    """A cell's trainer replica, as a switch and the controller drive it (`Replica`)."""

    busy: bool

    def join(self, host: str, port: int, step: int) -> dict[str, Any]: ...  # pull_s; late: the step ended

    def leave_step(self) -> dict[str, Any]: ...  # after its current micro-batch; handoff_s

    def poll(self) -> dict[str, Any] | None: ...  # the result of a step it finished on its own

    def stop(self) -> None: ...


class GatewayEngine:
    """A cell's engine process behind the gateway, through their admin endpoints."""

    def __init__(self, admin: AdminClient, spec: CellSpec):
        self.admin, self.spec = admin, spec

    def drain(self) -> DrainReport:
        return self.admin.drain(self.spec.engine_id)

    def sleep(self) -> None:
        self.admin.sleep(self.spec.engine_url)

    def wake(self, version: int, weights_path: str) -> None:
        self.admin.wake(self.spec.engine_url, weights_path, version)

    def register(self) -> None:
        self.admin.activate(self.spec.engine_id)


class Listed(NamedTuple):
    """A live engine as the gateway lists it: where it serves, its trainer replica, its sessions."""

    url: str
    trainer_url: str | None
    sessions: int = 0


@dataclass
class Cell:
    spec: CellSpec
    engine: EngineEnd
    replica: TrainerEnd | None = None  # None: the core cell (the core trains in every step)
    role: Role = "rollout"
    since: float = 0.0


class CellPool:
    """The cells of one campaign, their roles, and the switches between them (a log of `Switch`).
    ``sessions()``: engine id -> its live sessions (what a policy sees); ``on_close``: called last by
    ``close``; ``partition``: the cells' CPU cgroups (their owner, the stack, removes them).

    ``follow``: the cells are on hosts, and one whose host was lost is started again elsewhere under
    its id (stack/fleet.py); ``follow()`` gives each live engine id's `Listed` (URL, trainer URL,
    sessions) as the gateway lists it now (one listing a tick: the sessions come with it), and ``moved_to(cell, url, trainer_url)`` gives a moved cell its new ends. A moved
    cell serves (rollout) from then on: ``take_moved()`` names it once, for its version to be served."""

    def __init__(
        self,
        cells: list[Cell],
        *,
        sessions: Callable[[], dict[str, int]] | None = None,
        on_close: Callable[[], None] | None = None,
        clock=time.monotonic,
        partition: CpuPartition | None = None,
        follow: Callable[[], dict[str, Listed]] | None = None,
        moved_to: Callable[[Cell, str, str | None], None] | None = None,
    ):
        if sum(c.spec.core for c in cells) > 1:
            raise ValueError(
                f"a pool has one core cell at most; got {[c.spec.cell_id for c in cells if c.spec.core]}"
            )
        self.clock, self._sessions, self._on_close = clock, sessions, on_close
        self._follow, self._moved_to = follow, moved_to
        self.started = clock()
        self.cells = {c.spec.cell_id: c for c in cells}
        self.switches: list[Switch] = []
        self.moves: list[tuple[float, str, str, str]] = []  # (now, cell id, old URL, new URL)
        self.lost: set[str] = set()  # cells whose engine the gateway holds dead (with ``follow``)
        self._unserved: list[str] = []
        self._listed: dict[str, Listed] = {}  # the gateway's last listing (with ``follow``)
        self.partition = partition or CpuPartition.none()

    @classmethod
    def behind_gateway(
        cls,
        admin: AdminClient,
        specs: list[CellSpec],
        model_dir: str,
        *,
        threads: int = 1,
        loss: dict | None = None,
        clock=time.monotonic,
        cells: list[CellDevices] | None = None,
        partition: CpuPartition | None = None,
        replicas: dict[str, TrainerEnd] | None = None,
        remote: Callable[[str], TrainerEnd] | None = None,
    ) -> CellPool:
        """A campaign's cells: each spec's engine behind the gateway and, but for the core's, a replica
        process of ``model_dir`` (``threads`` torch threads) started here and ready, or with
        ``replicas`` the replica each cell already has (by cell id: scheduler/remote.py, a cell on
        another host; ``remote(trainer_url)`` makes one for a cell that moved host, whose moves the pool
        then follows). ``cells``: each spec's devices (its replica takes its cell's GPUs, cores,
        threads and CPU cgroup); ``partition``: those cgroups, read by ``cpu_usage_s``."""
        if sum(s.core for s in specs) != 1:
            raise ValueError(
                f"a pool needs exactly one core cell; got {[s.cell_id for s in specs if s.core]}"
            )
        if cells is not None and len(cells) != len(specs):
            raise ValueError(f"{len(cells)} cells' devices for {len(specs)} cells")

        def replica(i: int, spec: CellSpec) -> TrainerEnd | None:
            if spec.core:
                return None
            if replicas is not None:
                return replicas[spec.cell_id]
            return Replica(model_dir, threads, loss, cells[i] if cells else None)

        pool = [Cell(s, GatewayEngine(admin, s), replica(i, s)) for i, s in enumerate(specs)]
        for cell in pool:
            if isinstance(cell.replica, Replica):
                cell.replica.wait_ready()

        def sessions() -> dict[str, int]:
            return {e.engine_id: e.sessions for e in admin.gateway_stats().engines}

        follow = moved_to = None
        if remote is not None:

            def follow() -> dict[str, Listed]:
                live = [e for e in admin.gateway_stats().engines if e.state != "dead"]
                return {e.engine_id: Listed(e.url, e.trainer_url, e.sessions) for e in live}

            def moved_to(cell: Cell, url: str, trainer_url: str | None) -> None:
                cell.spec = dataclasses.replace(cell.spec, engine_url=url)
                cell.engine = GatewayEngine(admin, cell.spec)
                if not cell.spec.core:  # the old replica went with its host (the core evicts it)
                    if trainer_url is None:
                        raise RuntimeError(
                            f"cell {cell.spec.cell_id} moved to {url} without a trainer replica"
                        )
                    cell.replica = remote(trainer_url)

        return cls(
            pool,
            sessions=sessions,
            on_close=admin.close,
            clock=clock,
            partition=partition,
            follow=follow,
            moved_to=moved_to,
        )

    def cpu_usage_s(self) -> dict[str, float | None]:
        """CPU seconds each cell's processes used so far, whatever their role ({}: not partitioned)."""
        return self.partition.usage_s()

    def now(self) -> float:
        return self.clock() - self.started

    def restart_clock(self) -> None:
        """`now()` counts from here (a run's start); each cell's `since` moves to the same instant on
        the new clock, so a cell that changed role long before the run has dwelled that long."""
        elapsed = self.now()
        self.started = self.clock()
        for cell in self.cells.values():
            cell.since -= elapsed

    def to_train(self, cell_id: str, step_address: tuple[str, int, int] | None) -> Switch:
        """drain -> sleep -> join (the core cell has no replica: it trains in the step already)."""
        cell = self.cells[cell_id]
        switch = Switch(cell_id, "train", time.time())
        mark = time.perf_counter()
        drained = cell.engine.drain()
        mark = _phase(switch, "drain", mark)
        switch.detail["migrated_sessions"] = drained.moved_with_kv
        switch.detail["drain_failed"] = drained.failed
        cell.engine.sleep()
        mark = _phase(switch, "sleep", mark)
        if cell.replica is not None and step_address is not None:
            info = cell.replica.join(*step_address)
            mark = _phase(switch, "join", mark)
            switch.detail["weight_pull_s"] = info.get("pull_s")
            switch.detail["late"] = bool(info.get("late"))
        return self._done(cell, "train", switch)

    def to_rollout(self, cell_id: str, version: int, weights_path: str) -> Switch:
        """leave -> wake -> register."""
        cell = self.cells[cell_id]
        switch = Switch(cell_id, "rollout", time.time())
        mark = time.perf_counter()
        if cell.replica is not None:
            left = cell.replica.leave_step()
            mark = _phase(switch, "leave", mark)
            switch.detail["handoff_s"] = left.get("handoff_s")
        cell.engine.wake(version, weights_path)
        mark = _phase(switch, "wake", mark)
        cell.engine.register()
        _phase(switch, "register", mark)
        return self._done(cell, "rollout", switch)

    def all_to_rollout(self, version: int, weights_path: str) -> list[Switch]:
        """Every cell in training back to rollout, serving ``version`` (a campaign's start, an evaluation)."""
        return [
            self.to_rollout(cell_id, version, weights_path)
            for cell_id, cell in self.cells.items()
            if cell.role == "train"
        ]

    def _done(self, cell: Cell, role: Role, switch: Switch) -> Switch:
        cell.role, cell.since = role, self.now()
        self.switches.append(switch)
        return switch

    def follow_moves(self) -> list[str]:
        """Cells the gateway lists at another URL than theirs (their host was lost: the fleet started
        them again elsewhere) take their new ends and serve; their ids. Cells it lists dead, or not
        at all, are ``lost`` until then."""
        if self._follow is None or self._moved_to is None:
            return []
        moved, listed = [], self._follow()
        self._listed = listed
        self.lost = {c.spec.cell_id for c in self.cells.values() if c.spec.engine_id not in listed}
        for engine_id, (url, trainer_url, _) in listed.items():
            cell = next((c for c in self.cells.values() if c.spec.engine_id == engine_id), None)
            if cell is None or url == cell.spec.engine_url:
                continue
            old = cell.spec.engine_url
            self._moved_to(cell, url, trainer_url)
            cell.role, cell.since = "rollout", self.now()
            self.moves.append((self.now(), cell.spec.cell_id, old, url))
            log.warning("cell %s moved: it serves at %s now (was %s)", cell.spec.cell_id, url, old)
            self._unserved.append(cell.spec.cell_id)
            moved.append(cell.spec.cell_id)
        return moved

    def take_moved(self) -> list[str]:
        """The cells that moved since the last call (each named once): their version is to be served."""
        moved, self._unserved = self._unserved, []
        return moved

    def states(self) -> tuple[CellState, ...]:
        """The cells as a policy sees them (sessions per engine from ``sessions``, or from the listing
        that ``follow`` gave: one call to the gateway a tick), moved cells followed."""
        self.follow_moves()
        if self._follow is not None:
            sessions = {engine_id: listed.sessions for engine_id, listed in self._listed.items()}
        else:
            sessions = self._sessions() if self._sessions is not None else {}
        return tuple(
            CellState(
                cell_id=c.spec.cell_id,
                role=c.role,
                core=c.spec.core,
                since=c.since,
                active_sessions=sessions.get(c.spec.engine_id, 0) if c.role == "rollout" else 0,
            )
            for c in self.cells.values()
        )

    def close(self) -> None:
        for cell in self.cells.values():
            if cell.replica:
                cell.replica.stop()
        if self._on_close is not None:
            self._on_close()


def _phase(switch: Switch, name: str, since: float) -> float:
    now = time.perf_counter()
    switch.phases[name] = round(now - since, 4)
    return now
