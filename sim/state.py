"""The simulation's modelled parts and its books: a cell (SimCell), an execution (SimExecution), the
per-step bookkeeping of dispatch, completion and training (StepBook), and what the run counts (Tally).
sim/run.py moves them through events."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class SimCell:
    idx: int
    cell_id: str
    core: bool
    role: str
    phase: str = "ready"
    since: float = 0.0
    hosted: int = 0
    decoding: int = 0
    kv_tokens: float = 0.0
    switch_gen: int = 0
    mark: float = 0.0  # start of the current role period (accounting)
    hosted_mark: float = 0.0  # last change of `hosted` (slot-occupancy accounting)
    sessions: set[SimExecution] = field(default_factory=set)


@dataclass(eq=False)
class SimExecution:
    step: int
    index: int
    cell: int = -1
    segment: int = 0
    decoding: bool = False
    seg_end: float = 0.0
    latency: float = 0.0
    gen: int = 0
    version: int = 0
    started: float = 0.0
    done: bool = False


@dataclass
class StepBook:
    """Per-step bookkeeping of dispatch, completion and training."""

    dispatched: list[int]
    finished_groups: list[int]
    group_left: list[list[int]]
    group_tokens: list[list[float]]
    backlog: list[float]


@dataclass
class Tally:
    role_s: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "train": 0.0})
    busy_s: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "train": 0.0})
    switches: int = 0
    migrations: int = 0
    timeouts: int = 0
    max_lag: int = 0
    over_4h: int = 0
    finished: int = 0
    first_dispatch: dict[int, float] = field(default_factory=dict)  # step -> seconds
    last_dispatch: dict[int, float] = field(default_factory=dict)
    last_finish: dict[int, float] = field(default_factory=dict)
    core_busy_s: float = 0.0  # shared cores only: core-seconds of work
