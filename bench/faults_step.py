"""One step of a fault row: its dispatch config, running it, and the audit of what it left in the store
(bench/faults.py says what each figure means). Every fault module imports this one: the local-stack
rows (faults_processes.py), the rows on a setup of their own (faults_scale.py) and the campaign rows
(faults_campaign.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from environments.dispatch import dispatch_missing
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.ledger import execution_id_for, step_ledger
from environments.problems import Problem
from environments.runner import ExecutionOutcome
from stack.stack import LocalStack
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig

POLICY = "data/policies/tiny-sft"
"""The policy every fault row serves (shipped: nothing to train first)."""
TRAINABLE = ("completed", "timeout")


def audit(store: StoreConfig, step: int, *groups: tuple[list[Problem], int]) -> dict[str, int]:
    """Lost, duplicated and unended work of one step (see the module docstring); ``groups``: the
    problems dispatched, each with its group size."""
    ledger = step_ledger(store, step)
    lost = duplicated = abandoned = 0
    members = [
        (problem, member) for problems, size in groups for problem in problems for member in range(size)
    ]
    for problem, member in members:
        endings = []
        for attempt in range(len(ledger.used) + 1):
            execution_id = execution_id_for(step, problem, member, None, attempt)
            if execution_id not in ledger.used:
                break
            row = ledger.ended.get(execution_id)
            if row is not None and row.status == "abandoned":
                abandoned += 1
            elif row is not None:
                endings.append(row)
        lost += not endings
        duplicated += sum(row.status in TRAINABLE for row in endings) > 1
    con = connect(Store(store))
    lost_calls, calls = con.execute(
        """SELECT coalesce(sum(greatest(e.n_calls - coalesce(c.n, 0), 0)), 0), coalesce(sum(c.n), 0)
           FROM executions e
           LEFT JOIN (SELECT execution_id, count(*) AS n FROM calls WHERE step = ? GROUP BY ALL) c
           USING (execution_id) WHERE e.step = ?""",
        [step, step],
    ).fetchone()
    duplicate_calls = con.execute(
        "SELECT count(*) - count(DISTINCT (execution_id, call_id)) FROM calls WHERE step = ?", [step]
    ).fetchone()[0]
    con.close()
    return {
        "lost": lost + int(lost_calls),
        "duplicated": duplicated + int(duplicate_calls),
        "unended": len(ledger.used - set(ledger.ended)),
        "abandoned": abandoned,
        "calls": int(calls),
    }


def survived(counts: dict[str, int], ok: bool = True) -> bool:
    return ok and counts["lost"] == 0 and counts["duplicated"] == 0 and counts["unended"] == 0


def step_config(step: int, group_size: int, root: str, **changes: Any) -> DispatchConfig:
    """Short executions of the tiny policy (two to four turns), four at a time."""
    base = DispatchConfig(
        step=step,
        group_size=group_size,
        concurrency=4,
        timeout_s=60.0,
        workspace_root=f"{root}/ws-{step}",
        durations=DurationProfile(short_turns=3, long_fraction=0.0),
    )
    return replace(base, **changes)


def run_step(
    stack: LocalStack, problems: list[Problem], config: DispatchConfig, on_outcome=None
) -> list[ExecutionOutcome]:
    outcomes, _ = asyncio.run(
        dispatch_missing(problems, stack.gateway_url, stack.admin_token, stack.store, config, on_outcome)
    )
    return outcomes


def tally(
    name: str, results: list[tuple[dict[str, int], bool, float | None]], **detail: Any
) -> dict[str, Any]:
    recoveries = [r for _, _, r in results if r is not None]
    return {
        "name": name,
        "runs": len(results),
        "survived": sum(survived(counts, ok) for counts, ok, _ in results),
        "lost": sum(counts["lost"] for counts, _, _ in results),
        "duplicated": sum(counts["duplicated"] for counts, _, _ in results),
        "recovery_s": round(max(recoveries), 2) if recoveries else None,
        "unended": sum(counts["unended"] for counts, _, _ in results),
        "abandoned": sum(counts["abandoned"] for counts, _, _ in results),
        **detail,
    }
