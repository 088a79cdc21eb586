"""What a controller's run reports (scheduler/controller.py): each step it trained (`StepDone`), every
switch, the cells' role timeline, the executions, and the figures read from them: makespan, switch
latencies per direction and per phase, the share of cell-seconds in each role, and the share of the
machine's cores kept busy while it ran.

    report = asyncio.run(controller.run(work))
    report.figures(), report.role_share(), report.phases(), report.cpu_busy

`cpu_busy` is the honest idle figure when cells share cores (SCHEDULER-NOTES.md): on shared cores a
freed cell frees nothing, so a gain must show as cores kept busier while the tail finishes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel

from engines.quantiles import quantile
from scheduler.cells import Switch


@dataclass(frozen=True)
class Outcome:
    """How one execution ended (what the controller counts, and what a group waits for)."""

    execution_id: str
    group_id: str
    status: str
    reward: float


@dataclass(frozen=True)
class StepDone:
    """A step whose version the core published, as the controller saw it: seconds since the run
    began (``*_s``) and wall-clock times (``*_at``, time.time(): what the store records)."""

    step: int
    version: int
    executions: int
    groups_trained: int
    groups_skipped: int
    rollout_s: float  # its first dispatch to its last execution's end
    rolled_out_s: float
    ended_s: float
    started_at: float  # its first dispatch (every member ended before a restart: rolled_out_at)
    rolled_out_at: float  # its last execution's end
    ended_at: float  # its version published
    metrics: dict[str, float]  # the core's
    figures: dict[str, float] = field(default_factory=dict)  # its groups' packing counts, summed


@dataclass
class RunReport:
    makespan_s: float
    steps: list[StepDone]
    switches: list[Switch]
    timeline: list[tuple[float, str, str]]  # (seconds, cell id, role): every role change
    decisions: int
    outcomes: list[Outcome]
    cpu_busy: float | None = None  # the machine's cores' busy share while it ran (cpu_busy)
    core_start_s: float = 0.0  # the core's start-up before the clock (Controller.run), not in makespan_s

    def figures(self) -> dict[str, Any]:
        by = {"train": [], "rollout": []}
        for s in self.switches:
            by[s.to].append(s.seconds)
        return {
            "makespan_s": round(self.makespan_s, 2),
            "core_start_s": round(self.core_start_s, 2),
            "switches": len(self.switches),
            "switch_to_train_s": sorted(by["train"]),
            "switch_to_rollout_s": sorted(by["rollout"]),
            "executions": len(self.outcomes),
            "mean_reward": sum(o.reward for o in self.outcomes) / max(len(self.outcomes), 1),
            "steps": [asdict(step) for step in self.steps],
        }

    def role_share(self) -> dict[str, float]:
        """Share of cell-seconds spent in each role over the run (from the role timeline)."""
        end = self.makespan_s
        spent = {"rollout": 0.0, "train": 0.0}
        by_cell: dict[str, list[tuple[float, str]]] = {}
        for t, cell, role in self.timeline:
            by_cell.setdefault(cell, []).append((t, role))
        for changes in by_cell.values():
            changes.sort()
            for (t, role), (t_next, _) in zip(changes, [*changes[1:], (end, "")], strict=True):
                spent[role] += max(0.0, min(t_next, end) - t)
        total = sum(spent.values()) or 1.0
        return {role: round(s / total, 3) for role, s in spent.items()}

    def phases(self) -> dict[str, dict[str, float]]:
        """p50 and p95 seconds of every phase of the switches (drain, sleep, join / leave, wake, register)."""
        seen: dict[str, list[float]] = {}
        for switch in self.switches:
            for phase, seconds in switch.phases.items():
                seen.setdefault(f"{switch.to}.{phase}", []).append(seconds)
        return {
            name: {"p50": round(quantile(v, 0.5), 3), "p95": round(quantile(v, 0.95), 3)}
            for name, v in sorted(seen.items())
        }


# -- what the scheduler process says to the campaign flow: one Message a line on its stdout ------------


class Heartbeat(BaseModel):
    """Every tick: the controller's clock, the trained version, executions so far, each cell's role and
    the cells switching (``preparing``: what it waits for before its clock starts, e.g. "core")."""

    t: float
    version: int
    dispatched: int
    finished: int
    roles: dict[str, str]
    switching: list[str]
    errors: int
    wall: float
    preparing: str | None = None


class Committed(BaseModel):
    """A step committed: the version it made, when (wall clock)."""

    step: int
    version: int
    wall: float


class Done(BaseModel):
    """The run's end: the last version, every switch (cell, direction, seconds, phases), the errors."""

    version: int
    switches: list[dict[str, Any]]
    errors: list[str]


class Message(BaseModel):
    """One line of the scheduler process: exactly one of its fields set.

    print(Message(committed=Committed(step=3, version=4, wall=time.time())).line())
    message = Message.parse(line)     # ValueError naming what was wrong with the line
    """

    heartbeat: Heartbeat | None = None
    committed: Committed | None = None
    done: Done | None = None

    def line(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def parse(cls, line: str) -> Message:
        try:
            message = cls.model_validate_json(line)
        except ValueError as error:
            raise ValueError(f"not a scheduler message: {line.strip()[:200]!r} ({error})") from None
        if len(message.model_fields_set) != 1:
            raise ValueError(
                f"a scheduler message holds one of heartbeat, committed, done: {line.strip()[:200]!r}"
            )
        return message


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of every core since boot, from /proc/stat; None where it is absent."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def cpu_busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the cores' time spent busy between two `cpu_times` readings (every process: the
    figure of a run on a quiet machine)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)
