"""`gyre bench faults [--quick]`: faults and load on real processes, each audited for lost and
duplicated work.

Every fault row runs a step of executions against a local stack (two rollout engine processes
serving the shipped tiny policy, the gateway process, a store folder), breaks something, and audits
the step in the store (`audit`):

- lost: group members with no ending (no executions row, or only abandoned attempts), plus calls
  the gateway answered (executions.n_calls) with no row in calls;
- duplicated: members with more than one ending that would be trained (a sample trained twice),
  plus (execution_id, call_id) keys stored twice;
- unended: ids that took calls and have no executions row at all (a status never recorded);
- survived: lost, duplicated and unended are 0 and the row's own check holds.

Rows (what breaks, and what recovery_s measures):
- `dispatcher SIGKILL mid-step`: the process running the step's dispatcher dies with executions
  live; the dispatcher runs again (as the Prefect task's retry does). Recovery: from the kill until
  every member has ended.
- `gateway SIGKILL mid-step`: the gateway dies with executions live and calls not yet flushed; it
  is started again with the same config and the dispatcher runs again. Recovery: from the restart
  until every member has ended.
- `rollout engine SIGKILL mid-decode`: one of the two engine processes dies with calls in flight;
  the gateway reroutes its sessions. Recovery: from the kill to the first call answered after it.
- `harness exits at once`, `harness hangs`, `harness floods the gateway`, `workspace disk quota
  filled`: misbehaving agents, next to well-behaved executions of the same step. Recovery: from the
  fault (the exit, the deadline) to the execution's recorded ending, where there is one.
- `S3 store stopped 30 s`: the store is S3 (moto's server on loopback); it stops while calls are
  being recorded and comes back 30 s later. Recovery: from its return until a flush goes through.
- `2,000 executions in one step`: the campaign's roll-out task in a Prefect flow (an ephemeral
  Prefect server), a one-call curl agent: the Prefect task runs it costs, and every execution in SQL.
- `gateway load`: bench/load_gateway.py (concurrent multi-turn sessions, p50/p99 latency and the
  gateway's own overhead).
- the campaign rows (bench/faults_campaign.py says each): a process of a running `gyre run` campaign
  SIGKILLed (the campaign process, the trainer, the Prefect server, an engine, the gateway, the
  scheduler service, the trainer core under it), audited over every step of the campaign, with
  trained-twice counted by (execution_id, trajectory_id) over the packed batches.
- `satellite SIGKILL mid-step`: an elastic training step whose satellite dies after its first
  micro-batch; lost and duplicated count micro-batches, and the update must equal the core's alone.

`--only PART,...` (processes, s3, big, load, campaign, satellite) runs those parts and writes their
rows in place of the same rows of the output file.

Figures go to bench/results/faults.json: {"rows": [{name, runs, survived, lost, duplicated,
recovery_s, ...}], ...}.

Pieces: faults_step.py (a row's step, the audit and the row's tally: what every fault module
shares), faults_processes.py (the rows on one local stack), faults_scale.py (S3, the 2,000-execution
step, the satellite), faults_campaign.py (the campaign rows); this module runs the parts and writes
the file.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import Any

from bench import faults_campaign
from bench.faults_processes import process_rows
from bench.faults_scale import big_step, s3_stall, satellite_kill
from bench.faults_step import POLICY, tally
from bench.figures import write_figures
from tasks.rollout import choose_problems

DEFAULT_OUT = "bench/results/faults.json"
SIZES = {
    True: {
        "runs": 1,
        "problems": 3,
        "group_size": 2,
        "stall_s": 30.0,
        "big_step": 200,
        "load_sessions": 64,
        "load_seconds": 20.0,
        "campaign_runs": 1,
    },
    False: {
        "runs": 3,
        "problems": 4,
        "group_size": 4,
        "stall_s": 30.0,
        "big_step": 2000,
        "load_sessions": 256,
        "load_seconds": 120.0,
        "campaign_runs": 1,
    },
}


PARTS = ("processes", "s3", "big", "load", "campaign", "satellite")


def run(quick: bool, parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """The rows of ``parts``: processes (misbehaving harnesses, dispatcher, gateway and engine kills on a
    local stack), s3 (the store stalls), big (the 2,000-execution step), load (the gateway), campaign
    (processes of a running campaign killed: bench/faults_campaign.py), satellite (an elastic step)."""
    size = SIZES[quick]
    root = tempfile.mkdtemp(prefix="gyre-faults-")
    rows = []
    started = time.monotonic()
    if "processes" in parts:
        rows += process_rows(size, root)
    problems = choose_problems("mixed", size["problems"], seed=11)
    if "s3" in parts:
        counts, ok, recovery, statuses = s3_stall(problems, size["group_size"], root, size["stall_s"])
        name = f"S3 store stopped {size['stall_s']:.0f} s"
        rows.append(tally(name, [(counts, ok, recovery)], statuses=statuses))
        print(json.dumps(rows[-1]), flush=True)
    if "big" in parts:
        counts, ok, detail = big_step(size["big_step"], root)
        rows.append(tally(f"{size['big_step']:,} executions in one step", [(counts, ok, None)], **detail))
        print(json.dumps(rows[-1]), flush=True)
    if "load" in parts:
        from bench.load_gateway import gateway_load

        load = gateway_load(size["load_sessions"], size["load_seconds"], root=f"{root}/load")
        rows.append({**load, "recovery_s": None})  # nothing breaks: nothing to recover from
        print(json.dumps(rows[-1]), flush=True)
    if "campaign" in parts:
        rows += campaign_rows(size, root)
    if "satellite" in parts:
        counts, ok, recovery, detail = satellite_kill(root)
        rows.append(tally("satellite SIGKILL mid-step", [(counts, ok, recovery)], **detail))
        print(json.dumps(rows[-1]), flush=True)
    return {
        "quick": quick,
        "rows": rows,
        "all_survived": all(r["survived"] == r["runs"] for r in rows),
        "wall_s": round(time.monotonic() - started, 1),
    }


def campaign_rows(size: dict[str, Any], root: str) -> list[dict[str, Any]]:
    from pathlib import Path

    folder = Path(root) / "campaign"
    folder.mkdir()
    rows = []
    try:
        for name, job in faults_campaign.rows(folder, POLICY, quick=size["runs"] == 1):
            results, details = [], []
            for _ in range(size["campaign_runs"]):
                counts, ok, recovery, detail = job()
                results.append((counts, ok, recovery))
                details.append(detail)
            rows.append(tally(name, results, detail=details))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        faults_campaign.stop_services(folder)
    return rows


def print_table(figures: dict[str, Any]) -> None:
    print(f"{'fault or load':<36} {'runs':>4} {'survived':>8} {'lost':>5} {'dup':>4} {'recovery s':>10}")
    for row in figures["rows"]:
        recovery = "-" if row["recovery_s"] is None else f"{row['recovery_s']:.2f}"
        print(
            f"{row['name']:<36} {row['runs']:>4} {row['survived']:>8} {row['lost']:>5} "
            f"{row['duplicated']:>4} {recovery:>10}"
        )


def merged(figures: dict[str, Any], out: str, only: tuple[str, ...]) -> dict[str, Any]:
    """``figures``' rows in place of the same rows of the file ``out`` (the other rows kept, in order):
    what `--only` writes. Each row says when it was measured and whether quick."""
    try:
        with open(out) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return figures
    new = {row["name"]: row for row in figures["rows"]}
    rows = [new.pop(row["name"], row) for row in old.get("rows", [])] + list(new.values())
    run = {"parts": list(only), "wall_s": figures["wall_s"], "measured": time.strftime("%Y-%m-%d")}
    return {
        **old,  # wall_s stays the full run's
        "rows": rows,
        "all_survived": all(r["survived"] == r["runs"] for r in rows),
        "only_runs": [*old.get("only_runs", []), run],
    }


def main(quick: bool = False, out: str = DEFAULT_OUT, only: tuple[str, ...] = ()) -> int:
    unknown = set(only) - set(PARTS)
    if unknown:
        raise ValueError(f"--only: unknown part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    figures = run(quick, tuple(only) or PARTS)
    stamp = time.strftime("%Y-%m-%d")
    for row in figures["rows"]:
        row |= {"measured": stamp, "quick": quick}
    if only:
        figures = merged(figures, out, only)
    print_table(figures)
    write_figures(figures, out, indent=2)
    return 0 if figures["all_survived"] else 1


if __name__ == "__main__":
    only = tuple(a.removeprefix("--only=") for a in sys.argv[1:] if a.startswith("--only="))
    sys.exit(main(quick="--quick" in sys.argv, only=tuple(p for o in only for p in o.split(","))))
