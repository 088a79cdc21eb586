"""The three scheduling policies for real, on this machine's CPU: the same cells, the same work.

    python -m bench.schedule_real [--quick] [--partition none]   # also `gyre bench schedule` (`real`)

One serving stack (an engine per cell, one torch thread each, the gateway) and one `CellPool` (a
replica process per non-core cell) serve every policy in turn; each policy runs the same steps of
the same problems with the same work (heavy-tailed executions: a quarter of them run 3-6 times the
turns of the rest, the same quarter for every policy, and the same sampling seeds:
`DispatchConfig.same_work_across_runs`; before 2026-12-05 the run id keyed both, so each policy drew
its own long executions)
as its own campaign in one data root, starting from the shipped warm start, with the controller of
scheduler/controller.py deciding roles and dispatch every tick. Between policies every cell goes
back to rollout and every engine back to version 0.

The cells own their CPU share (``--partition cgroup``, the default; engines/devices/cpu_quota.py): a
cgroup per cell with a quota holds its engine, its replica and, for cell-0, the core trainer, so an
idle cell's share is lost as an idle GPU is and a cell that switches to training brings its share. The
processes of no cell (the gateway, the dispatcher, every harness and the commands it runs: what a GPU
host runs on its CPUs, beside its devices) get the host's share, HOST_CORES (1 core), and the four
cells share the other core (0.25 each): without it they took what the cells left, the machine stayed
full, and no cell's quota ever bound. Where the machine refuses cgroups
(not root, no cgroup cpu controller) one warning says so, the cells share the cores, and the figures
say ``partitioned: false``: an elastic gain cannot show then (an idle cell's CPU already goes to the
others). Each policy's CPU use per cell (seconds, and cores = seconds over the run's wall time) is
read from the cgroups.

Figures per policy: makespan (first dispatch to the last step's published version), switches and
their latency per phase, the share of cell-seconds in each role, the share of the cores' time kept
busy (`cpu_busy`: on shared cores a freed cell frees nothing, so a gain must show as cores kept
busier while the tail finishes), executions, mean rollout reward
(the reward of the executions each campaign trained on: the policies must not differ in what they
learn from, only in when), the held-out pass rate of each campaign's last version (24 problems of
generator seed 0, greedy: a speedup counts only at matching scores), and the steps' figures.

Pieces: bench/schedule_real_work.py (the policies and the work), bench/schedule_real_stack.py
(the stack, the pool and one policy's campaign: RealBench), bench/schedule_real_sim.py (the simulator
calibrated on the runs, and the what-if); this module runs the comparison and its command line.
`cell_cpu_s` is imported here again (``import X as X``) for tests/test_partition.py.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Any, Literal

import numpy as np

from bench.schedule_real_sim import CALIBRATION_STREAMING, WHAT_IF_RATES, sim_check, what_if
from bench.schedule_real_stack import RealBench
from bench.schedule_real_stack import cell_cpu_s as cell_cpu_s
from bench.schedule_real_work import CELLS, DURATIONS, HOST_CORES, MAX_TOKENS, POLICIES, WORKLOADS, RealWork
from engines.quantiles import quantile
from sim.calibrate import load_measured, measured_suite, save_measured

CALIBRATION_SEED = 8000  # the calibration runs' problems; the compared runs use RealWork.seed
ROUNDS = 2  # every policy runs this many times, in turn (quick: once): the machine's noise, measured


def compare(
    quick: bool = False,
    root: str | None = None,
    rounds: int | None = None,
    measured_out: str | None = None,
    partition: Literal["cgroup", "none"] = "cgroup",
    workload: str = "default",
) -> dict[str, Any]:
    """Every policy of POLICIES on the same work and cells, `rounds` times in turn (colocate, async,
    elastic, colocate, ...), then the simulator calibrated on a colocate and an async run of other problems
    predicting each run: the `real` section of schedule.json. A policy's makespan is the mean over
    its rounds (`makespan_rounds_s` has each); its other figures are its first round's.
    `measured_out`: also write every run's executions there (JSON, `sim.calibrate.save_measured`),
    so `python -m bench.schedule_real --measured FILE` checks the simulator against them again.
    ``partition``: 'cgroup' (each cell owns its CPU share) or 'none' (the cells share the cores)."""
    rounds = rounds or (1 if quick else ROUNDS)
    shape = {**WORKLOADS[workload], **({"problems_per_step": 6} if quick else {})}
    work = RealWork(steps=2 if quick else 3, seed=7000, **shape)
    calibration_work = dataclasses.replace(work, seed=CALIBRATION_SEED)
    own = root is None
    root = root or tempfile.mkdtemp(prefix="gyre-schedule-real-")
    runs_of: dict[str, list[dict[str, Any]]] = {}
    try:
        with RealBench(root, partition=partition) as bench:
            partitioned = bench.partitioned
            runs = [
                ("calibration", "calibration", "colocate", {}, calibration_work),
                (CALIBRATION_STREAMING, CALIBRATION_STREAMING, *POLICIES["async"], calibration_work),
            ]
            runs += [
                (label, label if r == 0 else f"{label}-r{r}", policy, params, work)
                for r in range(rounds)
                for label, (policy, params) in POLICIES.items()
            ]
            for label, run_label, policy, params, chosen in runs:
                started = time.perf_counter()
                row = bench.run(run_label, policy, params, chosen)
                runs_of.setdefault(label, []).append(row)
                busy = "-" if row["cpu_busy"] is None else f"{row['cpu_busy']:.2f}"
                cores = " ".join(f"{c:.2f}" for c in row["cpu_cores_by_cell"].values()) or "-"
                if row["host_cpu_cores"] is not None:
                    cores += f"  host {row['host_cpu_cores']:.2f}"
                print(
                    f"real {run_label:<12} makespan {row['makespan_s']:7.1f} s  switches {row['switches']:3d}  "
                    f"train share {row['role_share']['train']:.2f}  cpu busy {busy}  cell cores {cores}  "
                    f"errors {len(row['errors'])}  "
                    f"({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
            start_s = bench.start_s
        failed = {row["policy"]: row["errors"] for rows in runs_of.values() for row in rows if row["errors"]}
        if failed:  # a figure from a run whose executions or switches failed would mislead
            raise RuntimeError(f"policies with errors: {failed}")
    except BaseException:
        if own:
            print(f"the real runs failed: their stores and logs are kept in {root}", flush=True)
        raise
    if own:
        shutil.rmtree(root, ignore_errors=True)
    measured = {label: [row.pop("measured") for row in rows] for label, rows in runs_of.items()}
    if measured_out:
        save_measured(measured, measured_out)
    calibration = runs_of.pop("calibration")[0]
    calibration_streaming = runs_of.pop(CALIBRATION_STREAMING)[0]
    machine, sim_vs_real = sim_check(measured)
    rate = machine.trainer.tokens_per_s
    heavier = what_if(machine, measured, [round(rate * share, 1) for share in WHAT_IF_RATES])
    rows: dict[str, dict[str, Any]] = {}
    for label in POLICIES:
        spans = [row["makespan_s"] for row in runs_of[label]]
        rows[label] = {
            **runs_of[label][0],
            "makespan_s": round(float(np.mean(spans)), 2),
            "makespan_rounds_s": spans,
            "cpu_busy_rounds": [row["cpu_busy"] for row in runs_of[label]],
        }
        busy = [b for b in rows[label]["cpu_busy_rounds"] if b is not None]
        rows[label]["cpu_busy"] = round(float(np.mean(busy)), 3) if busy else None
    to_train = [s for runs in runs_of.values() for row in runs for s in row["switch_to_train_s"]]
    to_rollout = [s for runs in runs_of.values() for row in runs for s in row["switch_to_rollout_s"]]
    elastic = rows["elastic"]["makespan_s"]
    return {
        "work": {
            "steps": work.steps,
            "problems_per_step": work.problems_per_step,
            "group_size": work.group_size,
            "seed": work.seed,
            "calibration_seed": CALIBRATION_SEED,
            "cells": CELLS,
            "workload": workload,
            "temperature": work.temperature,
            "sessions_per_cell": work.sessions_per_cell,
            "durations": DURATIONS.__dict__,
            "max_tokens": MAX_TOKENS,
            "host_cores": HOST_CORES if partitioned else None,
            "cell_cores": round((len(os.sched_getaffinity(0)) - HOST_CORES) / CELLS, 3)
            if partitioned
            else None,
        },
        "pool_start_s": round(start_s, 1),
        "partitioned": partitioned,  # every cell in a CPU cgroup with its share as quota
        "policies": rows,
        "makespan_s": {label: row["makespan_s"] for label, row in rows.items()},
        "speedup_vs_async": round(rows["async"]["makespan_s"] / elastic, 4),
        "speedup_vs_colocate": round(rows["colocate"]["makespan_s"] / elastic, 4),
        "rounds": rounds,
        # per round, each policy's makespan over elastic's of the same round: how far noise moves it
        "speedup_vs_async_rounds": [
            round(a / e, 4)
            for a, e in zip(
                rows["async"]["makespan_rounds_s"], rows["elastic"]["makespan_rounds_s"], strict=True
            )
        ],
        "speedup_vs_colocate_rounds": [
            round(c / e, 4)
            for c, e in zip(
                rows["colocate"]["makespan_rounds_s"], rows["elastic"]["makespan_rounds_s"], strict=True
            )
        ],
        "reward_by_policy": {label: round(row["mean_reward"], 4) for label, row in rows.items()},
        # each policy's campaign's last version on the same held-out problems, per round
        "held_out_pass_rate_by_policy": {
            label: [row["held_out_pass_rate"] for row in runs_of[label]] for label in POLICIES
        },
        "cpu_busy_by_policy": {label: row["cpu_busy"] for label, row in rows.items()},
        # per policy (its first round), each cell's CPU use from its cgroup: seconds, and cores
        "cpu_s_by_policy": {label: row["cpu_s_by_cell"] for label, row in rows.items()},
        "cpu_cores_by_policy": {label: row["cpu_cores_by_cell"] for label, row in rows.items()},
        "switch_s": {
            **{
                f"to_{role}_p{q}": None if (value := quantile(seconds, q / 100)) is None else round(value, 3)
                for role, seconds in (("train", to_train), ("rollout", to_rollout))
                for q in (50, 95)
            },
            "count": len(to_train) + len(to_rollout),
        },
        "calibration": {
            "makespan_s": calibration["makespan_s"],
            "streaming_makespan_s": calibration_streaming["makespan_s"],
            "latency_s_per_token": round(machine.engine.latency_fixed_s, 5),
            "update_s": round(machine.trainer.update_s, 2),
            "train_tokens_per_s": round(machine.trainer.tokens_per_s, 1),  # per cell, cores not shared
            "to_train_s": round(machine.to_train_s, 3),
            "to_rollout_s": round(machine.to_rollout_s, 3),
        },
        "sim_vs_real": sim_vs_real,
        "sim_vs_real_error": max(v["error"] for v in sim_vs_real.values()),
        # the calibrated simulator with every execution trained, at shares of the measured rate
        "what_if_every_group_trained": heavier,
    }


def main() -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    parser.add_argument("--measured-out", default=None, help="also write every run's executions here (JSON)")
    parser.add_argument(
        "--partition",
        choices=["cgroup", "none"],
        default="cgroup",
        help="cgroup: each cell owns its CPU share (a cgroup quota; needs root); none: the cells share the cores",
    )
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="default",
        help="default: the campaign's groups of 2; signal: groups of 4 at temperature 1.5, 6 executions "
        "a cell, so that more groups carry a signal and a step trains more",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"runs of each policy (default {ROUNDS}; quick 1)"
    )
    parser.add_argument(
        "--measured", default=None, help="no runs: check the simulator against the runs saved in this file"
    )
    parser.add_argument(
        "--what-if",
        type=float,
        nargs="+",
        default=None,
        metavar="TOKENS_PER_S",
        help="with --measured: predict every policy with every execution trained, at these tokens/s a train cell",
    )
    args = parser.parse_args()
    if args.what_if and not args.measured:
        parser.error("--what-if needs --measured FILE (the runs it predicts)")
    if args.what_if:
        measured = load_measured(args.measured)
        machine, _ = sim_check(measured)
        print(json.dumps(what_if(machine, measured, args.what_if), indent=1))
        return 0
    if args.measured:
        runs = load_measured(args.measured)
        machine, checked = sim_check(runs)
        calibration = runs["calibration"] + runs.get(CALIBRATION_STREAMING, [])
        fitted = {
            "update_s": round(machine.trainer.update_s, 2),
            "train_tokens_per_s": round(machine.trainer.tokens_per_s, 1),
            "latency_s_per_token": round(machine.engine.latency_fixed_s, 5),
            "to_train_s": round(machine.to_train_s, 2),
            "to_rollout_s": round(machine.to_rollout_s, 3),
            # the calibration runs' executions as a simulator suite (how sim/presets.py's cpu-small was fitted)
            "suite": dataclasses.asdict(measured_suite(calibration, "short")),
        }
        print(json.dumps({**fitted, "sim_vs_real": checked}, indent=1))
        return 0
    figures = compare(
        args.quick,
        rounds=args.rounds,
        measured_out=args.measured_out,
        partition=args.partition,
        workload=args.workload,
    )
    print(json.dumps({k: v for k, v in figures.items() if k != "policies"}, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(figures, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
