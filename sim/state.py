"""The simulation's modelled parts and its books: a cell (SimCell) and its engines (SimEngine), an
execution (SimExecution), the per-step bookkeeping of dispatch, completion and training (StepBook),
and what the run counts (Tally). sim/run.py moves them through events."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class SimEngine:
    """One rollout engine (a cell's devices, or a TP group of them): a continuous batch and a KV cache.

    Every decoding sequence gets one token per decode step, so the engine keeps one clock for all of
    them: `vclock` counts the tokens each decoding sequence has received since the start, and moves at
    one token per `step_s` (the step latency of the batch as it is now, recomputed whenever the batch
    changes). A sequence is done decoding when `vclock` reaches its `v_end`; `finishing` is a heap of
    (v_end, seq, execution, its decode generation)."""

    cell: int
    kv_capacity: float
    """Context tokens the KV cache holds."""
    max_sessions: int
    hosted: int = 0
    peak_hosted: int = 0
    kv_used: float = 0.0
    batch: int = 0
    context_sum: float = 0.0
    """Summed context of the sequences decoding now (attention reads per step)."""
    vclock: float = 0.0
    mark: float = 0.0
    step_s: float = 0.0
    gen: int = 0
    finishing: list = field(default_factory=list)


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
    engines: list[SimEngine] = field(default_factory=list)


@dataclass(eq=False)
class SimExecution:
    step: int
    index: int
    cell: int = -1
    segment: int = 0
    state: str = "new"
    """new | waiting (for KV room) | prefill | decode | gap | unplaced (in a tool gap, off any engine)"""
    engine: SimEngine | None = None
    kv: float = 0.0
    """Context tokens it holds in its engine's KV cache."""
    pending: float = 0.0
    """Tokens left to decode in the current segment once it (re)joins a batch."""
    prefill_due: float = 0.0
    """Tokens to prefill when it is next placed (the segment's new tokens, or its whole context
    after a preemption)."""
    v_end: float = 0.0
    seg_end: float = 0.0
    gen: int = 0
    version: int = 0
    started: float = 0.0
    done: bool = False


@dataclass
class StepBook:
    """Per-step bookkeeping of dispatch, completion and training."""

    dispatched: list[int]
    finished_groups: list[int]
    finished: list[int]
    group_left: list[list[int]]
    group_tokens: list[list[float]]
    backlog: list[float]
    held: list[float]
    """Tokens of finished groups not yet released to training (stream_training off)."""


@dataclass
class Tally:
    role_s: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "train": 0.0})
    busy_s: dict[str, float] = field(default_factory=lambda: {"rollout": 0.0, "train": 0.0})
    switches: int = 0
    migrations: int = 0
    preemptions: int = 0
    waited_s: float = 0.0  # execution-seconds spent waiting for KV room
    timeouts: int = 0
    max_lag: int = 0
    over_4h: int = 0
    finished: int = 0
    first_dispatch: dict[int, float] = field(default_factory=dict)  # step -> seconds
    last_dispatch: dict[int, float] = field(default_factory=dict)
    last_finish: dict[int, float] = field(default_factory=dict)
    core_busy_s: float = 0.0  # shared cores only: core-seconds of work
