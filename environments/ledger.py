"""Which executions of a step the store holds, and the ids a member's attempts take.

Execution ids are ``s<step>-<problem>-g<member>``, plus ``-<run_id>`` when DispatchConfig.run_id is set,
plus ``-a<k>`` for the k-th attempt of a member whose dispatcher died (attempt 0 has none). The ledger
of a step (read from its executions and calls only) says which attempt of a member ended and which id
the next attempt takes: the first one the store has never seen.
"""

from __future__ import annotations

from dataclasses import dataclass

from environments.problems import Problem
from trajectory_store.schema import Status
from trajectory_store.storage import Store, StoreConfig


def group_id_for(step: int, problem: Problem, run_id: str | None = None) -> str:
    return f"s{step}-{problem.problem_id}" + (f"-{run_id}" if run_id else "")


def execution_id_for(
    step: int, problem: Problem, member: int, run_id: str | None = None, attempt: int = 0
) -> str:
    """s<step>-<problem>-g<member>[-<run_id>][-a<attempt>]: the same for a retry of the same run
    (retry-safe); a later attempt of a member whose dispatcher died gets -a<k> (StepLedger)."""
    base = f"s{step}-{problem.problem_id}-g{member}" + (f"-{run_id}" if run_id else "")
    return base if attempt == 0 else f"{base}-a{attempt}"


@dataclass(frozen=True)
class Ended:
    """How one execution the store holds ended."""

    execution_id: str
    group_id: str | None
    status: Status
    reward: float | None


@dataclass(frozen=True)
class StepLedger:
    """What the store holds of one step: the executions that ended, and every id that took a call
    (a dispatcher or gateway that died leaves calls without an execution row)."""

    step: int
    ended: dict[str, Ended]
    used: frozenset[str]

    def outcome(self, problem: Problem, member: int, run_id: str | None = None) -> Ended | None:
        """The attempt of this member that ended (with any status but abandoned), if one did."""
        for attempt in range(len(self.used) + 1):
            execution_id = execution_id_for(self.step, problem, member, run_id, attempt)
            row = self.ended.get(execution_id)
            if row is not None and row.status != "abandoned":
                return row
            if execution_id not in self.used:
                return None
        return None

    def next_attempt(self, problem: Problem, member: int, run_id: str | None = None) -> int:
        """The first attempt of this member whose id the store has never seen."""
        attempt = 0
        while execution_id_for(self.step, problem, member, run_id, attempt) in self.used:
            attempt += 1
        return attempt


def step_ledger(store: StoreConfig, step: int) -> StepLedger:
    """The step's ledger, read from the store's executions and calls of that step only."""
    target = Store(store)
    rows = target.read_columns(
        "executions", ["execution_id", "group_id", "status", "reward"], step
    ).to_pylist()
    ended = {
        r["execution_id"]: Ended(r["execution_id"], r["group_id"], r["status"], r["reward"]) for r in rows
    }
    called = target.read_columns("calls", ["execution_id"], step).column("execution_id").to_pylist()
    return StepLedger(step, ended, frozenset(ended) | frozenset(called))
