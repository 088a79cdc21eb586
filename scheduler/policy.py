"""Scheduling policies: a snapshot of the cells and the work in, role changes and dispatches out.

Pure on purpose (DESIGN.md section 3): no I/O, no clock, no randomness, no import of our other
folders. The same code then drives the real cells (scheduler/service.py fills a `SchedulerState`
from gateway, engine and trainer figures on every tick) and the simulator (sim/run.py fills it
from modelled engines), and tests drive it with synthetic state sequences.

A controller's tick:

    state = SchedulerState(...)       # what is true now
    decision = policy.decide(state)   # what to change
    # 1. apply decision.roles: a cell leaving rollout has its sessions migrated to the engines that
    #    stay (never interrupted); a cell moving either way is "switching" until it serves its role
    # 2. apply decision.dispatch: start that many groups of that step on the ready rollout engines

Versions and staleness: version v is the weights after v optimizer updates, and step s trains on
top of version s, so an execution of step s dispatched while version v is served has policy lag
s - v. Every policy dispatches step s only while s - version <= max_policy_lag and
s < version + depth (`dispatchable`), so the lag of every trained call is bounded at dispatch.

The three policies (`make_policy("elastic" | "colocate" | "async", **config_fields)`):
- `Elastic`: the waterlevel policy. Rollout cells move to training one at a time while the ready
  rollout capacity left still hosts the unfinished and dispatchable work with headroom (the
  hysteresis), each cell keeps a role at least `min_dwell_s`, and a move happens only when it
  pays (predicted gain on the training backlog > the switch costs). New work pulls satellites
  back. The core always trains, unless `lend_core`: then it rolls out too while the step being
  trained rolls out its bulk, and trains from that step's tail until its update is published.
- `Colocate`: the whole pool flips: all rollout (the core too) until the step's executions have
  all finished, then all train until its update is published.
- `Async`: a static split (fixed train and rollout counts) with one step of overlap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Literal, Protocol

Role = Literal["rollout", "train"]
Phase = Literal["ready", "switching", "lost"]


@dataclass(frozen=True)
class CellState:
    """One cell as the controller sees it at a tick."""

    cell_id: str
    """Stable name of the cell (a process with a thread budget on CPU, a set of GPUs on GPU)."""
    role: Role
    """The role the cell holds or, while `phase` is "switching", the role it is moving into."""
    core: bool = False
    """The core holds the authoritative weights and the optimizer: it never leaves training
    (Colocate excepted: there the whole pool, the core included, rolls out between updates)."""
    phase: Phase = "ready"
    """"switching": draining, migrating, pulling weights or waking; it serves neither role yet.
    "lost": the gateway holds its engine dead (its host was cut off, its process died) until it
    serves again, on another host perhaps: no policy moves it, nothing is dispatched to it."""
    since: float = 0.0
    """When the cell's last role change began (seconds, the clock of `SchedulerState.now`)."""
    active_sessions: int = 0
    """Unfinished executions hosted by the cell's rollout engine (0 for a train cell)."""
    kv_used: float = 0.0
    """Fraction of the engine's KV cache in use (0..1): what leaving rollout would migrate."""


@dataclass(frozen=True)
class StepProgress:
    """One step that is not trained yet: how much of its batch is dispatched and finished."""

    step: int
    """The step index; its batch trains on top of policy version `step`."""
    executions: int
    """Executions the step's batch holds (problems x group size)."""
    dispatched: int = 0
    """Executions started so far (a group may be started across ticks)."""
    finished_groups: int = 0
    """Groups whose every execution has finished: formed into micro-batches for streaming training."""
    finished: int = 0
    """Executions finished so far (any status)."""

    @property
    def queued(self) -> int:
        """Executions sampled but not dispatched yet."""
        return self.executions - self.dispatched

    @property
    def left(self) -> int:
        """Executions not finished yet: queued or running."""
        return self.executions - self.finished


@dataclass(frozen=True)
class SchedulerState:
    """Everything a policy may look at. A real controller fills it from the gateway (sessions per
    engine, KV use), the dispatcher (dispatched, finished, steps), the trainer (version, backlog)
    and its own switch timings."""

    now: float
    """Seconds since the campaign began."""
    cells: tuple[CellState, ...]
    """Every cell of the pool, in a stable order."""
    sessions_per_cell: int
    """Executions one rollout cell can host at once (its KV cache at the suite's context lengths)."""
    dispatched: int
    """Executions dispatched since the campaign began."""
    finished: int
    """Executions finished (any status) since the campaign began."""
    steps: tuple[StepProgress, ...]
    """Steps not trained yet whose problems are sampled, oldest first (a window of the campaign)."""
    policy_version: int
    """Newest trained and published policy version (= optimizer updates done)."""
    oldest_behaviour_version: int | None = None
    """Oldest policy version any unfinished execution sampled with; None when none is unfinished."""
    train_backlog_s: float = 0.0
    """Cell-seconds of training ready and not yet done for the step being trained (queued
    micro-batch tokens over one train cell's measured tokens per second)."""
    switch_to_train_s: float = 8.5
    """Measured (p50) seconds for a cell to leave rollout and join the step being trained."""
    switch_to_rollout_s: float = 3.5
    """Measured (p50) seconds for a cell to leave training and serve as a rollout engine."""

    @property
    def waterlevel(self) -> int:
        """Dispatched minus finished executions: the unfinished rollout work."""
        return self.dispatched - self.finished

    @property
    def steps_in_flight(self) -> int:
        """Steps with dispatched executions that are not trained yet."""
        return sum(1 for step in self.steps if step.dispatched > 0)


@dataclass(frozen=True)
class Dispatch:
    """Start `executions` more executions of `step` now (the next ones in group order, so a
    group's members start together unless the slots run out mid-group)."""

    step: int
    executions: int


@dataclass(frozen=True)
class Decision:
    """What the controller applies at this tick: role changes first, then dispatches."""

    roles: Mapping[str, Role] = field(default_factory=dict)
    """cell_id -> the role it moves into (only cells that change)."""
    dispatch: tuple[Dispatch, ...] = ()
    """Executions to start, in order; they fit the free slots of rollout cells that stay ready."""
    reason: str = ""
    """A short why, for the service's log and the metrics table."""


class Policy(Protocol):
    """Anything that turns a state into a decision, with no side effects."""

    def decide(self, state: SchedulerState) -> Decision: ...


def dispatchable(state: SchedulerState, depth: int, max_policy_lag: int) -> list[StepProgress]:
    """Steps with queued groups that may start now: within `depth` steps of the trained version
    and within the staleness bound. Work carried over from older versions (the oldest behaviour
    version already past the bound) stops all new dispatches until it finishes."""
    version = state.policy_version
    oldest = state.oldest_behaviour_version
    if oldest is not None and version - oldest > max_policy_lag:
        return []
    return [
        step
        for step in state.steps
        if step.queued > 0 and step.step < version + depth and step.step - version <= max_policy_lag
    ]


def fill(state: SchedulerState, steps: list[StepProgress], ready_rollout_cells: int) -> tuple[Dispatch, ...]:
    """Oldest step first, into the free slots of `ready_rollout_cells` cells."""
    free = ready_rollout_cells * state.sessions_per_cell - state.waterlevel
    out = []
    for step in steps:
        count = min(step.queued, free)
        if count <= 0:
            break
        out.append(Dispatch(step.step, count))
        free -= count
    return tuple(out)


def _ready(state: SchedulerState, role: Role, moving: Mapping[str, Role]) -> int:
    """Ready cells of `role` that this decision does not move."""
    return sum(1 for c in state.cells if c.role == role and c.phase == "ready" and c.cell_id not in moving)


@dataclass(frozen=True)
class ElasticConfig:
    """The waterlevel policy's knobs."""

    depth: int = 2
    """Steps that may be in flight (dispatched, not trained): 1 is synchronous, 2 lets the next
    step roll out while this one's tail finishes and trains."""
    max_policy_lag: int = 1
    """Staleness bound: no trained call was sampled more than this many versions ago."""
    hysteresis: float = 0.5
    """Headroom, as a fraction of one cell's sessions, that must stay free after a cell leaves
    rollout; growing only happens when the work exceeds capacity, so small waterlevel
    fluctuations never flip a cell."""
    min_dwell_s: float = 60.0
    """A cell keeps its role at least this long after a switch began (no flapping)."""
    gain_factor: float = 1.0
    """Switch only when it pays: a cell joins training only if the predicted gain on the training
    backlog, backlog/n - backlog/(n+1) seconds with n train cells, exceeds gain_factor times the
    round trip (switch in + switch back). 0 moves whenever the capacity allows."""
    lend_core: bool = False
    """The core rolls out as well while the step being trained still rolls out its bulk (more of its
    executions are unfinished than one cell hosts), and trains from then until that
    step's update is published: it trains the groups that finished meanwhile at once, beside the
    step's tail. Satellites train only beside a training core (they go back to rollout with it, or
    before it). For work whose training is a small share of a step: a core that always trains idles
    between its micro-batches. Off: the core always trains."""


class Elastic:
    """Cells follow the waterlevel: idle rollout capacity trains, new work pulls it back."""

    def __init__(self, config: ElasticConfig | None = None) -> None:
        self.config = config or ElasticConfig()

    def decide(self, state: SchedulerState) -> Decision:
        cfg = self.config
        steps = dispatchable(state, cfg.depth, cfg.max_policy_lag)
        current = sum(step.queued for step in steps if step.step == state.policy_version)
        ahead = sum(step.queued for step in steps if step.step > state.policy_version)
        train = sum(1 for c in state.cells if c.role == "train")
        # The step being trained gates every later dispatch (depth), so its training comes before
        # rolling out a step ahead: work ahead only claims cells the trainer cannot use.
        demand = state.waterlevel + current + (0 if self._pays(state, train) else ahead)
        if cfg.lend_core:
            if self._core_target(state, steps) == "rollout":
                return self._lend(state, steps)
            lent = next((c for c in state.cells if c.core and c.role == "rollout"), None)
            if lent is not None:
                return self._reclaim(state, steps, lent)
        core: dict[str, Role] = {c.cell_id: "train" for c in state.cells if c.core and c.role != "train"}
        serving = sum(1 for c in state.cells if c.role == "rollout" and not c.core)
        wanted = math.ceil(demand / state.sessions_per_cell)
        if wanted > serving:
            roles = self._grow(state, wanted - serving)
            reason = f"work {demand} needs {wanted} rollout cells"
        else:
            roles = self._shrink(state, demand, _ready(state, "rollout", core), train)
            reason = f"waterlevel {state.waterlevel}, backlog {state.train_backlog_s:.0f} cell-s"
        roles.update(core)
        return Decision(roles, fill(state, steps, _ready(state, "rollout", roles)), reason)

    def _settled(self, cell: CellState, now: float) -> bool:
        return cell.phase == "ready" and now - cell.since >= self.config.min_dwell_s

    def _core_target(self, state: SchedulerState, steps: list[StepProgress]) -> Role:
        """lend_core: where the core is wanted. Training while the step being trained is closed (its
        update runs) or has every execution finished, while nothing waits to roll out, and once the
        step is in its tail: some of its groups in and no more of its executions unfinished than one
        cell hosts (the core's own share of rollout), so what finished meanwhile trains beside the
        tail. Rolling out before that."""
        current = next((s for s in state.steps if s.step == state.policy_version), None)
        if current is None or current.left == 0 or (state.waterlevel == 0 and not steps):
            return "train"
        if current.finished_groups > 0 and current.left <= state.sessions_per_cell:
            return "train"
        return "rollout"

    def _lend(self, state: SchedulerState, steps: list[StepProgress]) -> Decision:
        """The core rolls out: every satellite back to rollout first (a satellite trains only in the
        core's step), the core once none trains (and it has dwelled)."""
        roles: dict[str, Role] = {
            c.cell_id: "rollout"
            for c in state.cells
            if c.role == "train" and not c.core and self._settled(c, state.now)
        }
        training = any(c.role == "train" and not c.core and c.cell_id not in roles for c in state.cells)
        for c in state.cells:
            if c.core and c.role == "train" and not training and self._settled(c, state.now):
                roles[c.cell_id] = "rollout"
        reason = f"core lent to rollout: step {state.policy_version} rolls out its bulk"
        return Decision(roles, fill(state, steps, _ready(state, "rollout", roles)), reason)

    def _reclaim(self, state: SchedulerState, steps: list[StepProgress], core: CellState) -> Decision:
        """The lent core goes back to training once it has dwelled and the other ready rollout cells
        host every unfinished execution (its sessions move there); until then nothing new starts on
        it, so its sessions finish or fit."""
        others = _ready(state, "rollout", {core.cell_id: "train"})
        if self._settled(core, state.now) and others * state.sessions_per_cell >= state.waterlevel:
            roles: dict[str, Role] = {core.cell_id: "train"}
            reason = f"core back to training: step {state.policy_version}'s tail"
        else:
            roles, reason = {}, f"core wanted in training: waterlevel {state.waterlevel} drains to the others"
        return Decision(roles, fill(state, steps, others), reason)

    def _grow(self, state: SchedulerState, count: int) -> dict[str, Role]:
        """Satellites that have dwelled longest go back to rollout first."""
        satellites = [
            c for c in state.cells if c.role == "train" and not c.core and self._settled(c, state.now)
        ]
        satellites.sort(key=lambda c: (c.since, c.cell_id))
        return {c.cell_id: "rollout" for c in satellites[:count]}

    def _shrink(self, state: SchedulerState, demand: int, ready: int, train: int) -> dict[str, Role]:
        """One cell at a time, the least loaded first (least KV to migrate), while the ready
        capacity left hosts `demand` with headroom and the move pays. The headroom also keeps one
        rollout cell while any execution is unfinished: (n - 1) x sessions >= waterlevel > 0.
        `ready` counts the ready rollout cells that stay (the core excluded), `train` the cells
        training or joining."""
        cap = state.sessions_per_cell
        candidates = [
            c for c in state.cells if c.role == "rollout" and not c.core and self._settled(c, state.now)
        ]
        candidates.sort(key=lambda c: (c.active_sessions, c.kv_used, c.cell_id))
        roles: dict[str, Role] = {}
        for cell in candidates:
            if (ready - 1) * cap - demand < self.config.hysteresis * cap or not self._pays(state, train):
                break
            roles[cell.cell_id] = "train"
            ready -= 1
            train += 1
        return roles

    def _pays(self, state: SchedulerState, train_cells: int) -> bool:
        """Predicted gain of one more train cell on the backlog against the round-trip cost."""
        if self.config.gain_factor == 0:
            return True
        n = max(train_cells, 1)
        gain = state.train_backlog_s / (n * (n + 1))
        return gain > self.config.gain_factor * (state.switch_to_train_s + state.switch_to_rollout_s)


@dataclass(frozen=True)
class ColocateConfig:
    """Colocate has no knobs beyond the staleness it implies (synchronous: lag 0, depth 1)."""


class Colocate:
    """The whole pool flips: all rollout until the step's executions have finished, then all
    train until its update is published, then the next step."""

    def __init__(self, config: ColocateConfig | None = None) -> None:
        self.config = config or ColocateConfig()

    def decide(self, state: SchedulerState) -> Decision:
        steps = dispatchable(state, depth=1, max_policy_lag=0)
        rolling = state.waterlevel > 0 or bool(steps)
        target: Role = "rollout" if rolling else "train"
        roles = {c.cell_id: target for c in state.cells if c.role != target}
        dispatch = fill(state, steps, _ready(state, "rollout", roles)) if rolling else ()
        return Decision(roles, dispatch, f"phase {target}")


@dataclass(frozen=True)
class AsyncConfig:
    """A static split, as in one-step-off-policy systems."""

    train_cells: int = 1
    """Cells that always train, the core included; the rest always roll out. The best split
    depends on the workload: bench/schedule.py tries several and reports the best."""
    max_policy_lag: int = 1
    """One step of overlap: step s+1 rolls out while step s trains (depth = lag + 1)."""


class Async:
    """Fixed train and rollout cells: the core plus the first satellites by id train."""

    def __init__(self, config: AsyncConfig | None = None) -> None:
        self.config = config or AsyncConfig()

    def decide(self, state: SchedulerState) -> Decision:
        cfg = self.config
        others = sorted((c for c in state.cells if not c.core), key=lambda c: c.cell_id)
        if cfg.train_cells < 1 or cfg.train_cells >= len(state.cells):
            raise ValueError(
                f"train_cells is {cfg.train_cells}: give 1 .. {len(state.cells) - 1} of {len(state.cells)} cells"
            )
        trainers = {c.cell_id for c in state.cells if c.core} | {
            c.cell_id for c in others[: cfg.train_cells - 1]
        }
        roles: dict[str, Role] = {}
        for cell in state.cells:
            target: Role = "train" if cell.cell_id in trainers else "rollout"
            if cell.role != target:
                roles[cell.cell_id] = target
        steps = dispatchable(state, cfg.max_policy_lag + 1, cfg.max_policy_lag)
        return Decision(
            roles, fill(state, steps, _ready(state, "rollout", roles)), f"split {cfg.train_cells} train"
        )


POLICIES: dict[str, tuple[type, type]] = {
    "elastic": (Elastic, ElasticConfig),
    "colocate": (Colocate, ColocateConfig),
    "async": (Async, AsyncConfig),
}


def make_policy(name: str, **params: object) -> Policy:
    """The policy called `name`, configured by its config class's fields (e.g. depth=1)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
    policy_class, config_class = POLICIES[name]
    known = {f.name: f.type for f in fields(config_class)}
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(
            f"{name} has no setting {', '.join(unknown)}: its settings are {sorted(known) or 'none'}"
        )
    # a config's [scheduler] params are floats (TOML's 2 arrives as 2.0): a whole-number setting
    # takes its int. Before 2026-12-07 async's train_cells = 2 from a config crashed the scheduler.
    whole = {k for k, kind in known.items() if kind in (int, "int")}
    for key in whole & set(params):
        value = params[key]
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{name}'s {key} is a whole number; got {value}")
            params[key] = int(value)
    return policy_class(config_class(**params))
