"""The scheduler's three policies on three hosts, and the simulator's prediction of each: `gyre bench
hosts`' `elastic` section (issue 50).

Each row is bench/cluster.py's campaign under the scheduler service with one policy (colocate, async,
elastic), its three cells one on each of three hosts (network namespaces), on the same problems and
the same long-tailed workload (WORKLOAD): each cell an engine and a trainer replica on its host, the
core in the root namespace. A row's time is its steps' span (the first step's start to the last
commit: a scheduler's steps overlap); ``ROUNDS`` rounds, the policies in turn within each, the means
compared (``speedup_vs_async`` = async's mean / elastic's, ``speedup_vs_colocate`` likewise). Each
row's held-out evaluation of its last version is kept beside it. ``cut``: elastic again, four steps, with h3
cut off while step 0 rolls out there (lost, recorded twice, trained twice, the cell served again).

The simulator (``sim_vs_real_error``): calibrated on 1-host runs of the same workload (its three
cells on one host; sim/calibrate.py `calibrate`: colocate for the switches, async for the training
rate and the update, as bench/schedule_real.py calibrates), it predicts each 3-host row's span from
that row's executions under the row's policy, the weights reaching each host over its own link; the
error is |predicted - measured| / measured, the largest of the three rows. A decode step's cost per
sequence is measured on a cell of the same quota (``batch_cost``, bench/batch_cost.py), not assumed.
The runs it used are saved (``MEASURED``, sim/calibrate.py `save_measured`): ``python -m
bench.hosts_schedule --sim FILE [--hosts HOSTS_JSON [--update]]`` predicts again from them, without
running a campaign.

The hosts share this machine's two cores, and each cell owns a share of them ([cluster] cell_cpus,
``CELL_CPUS``: a cgroup quota its engine and replica share on its host; the core trains under the same
quota): a cell switched from rollout to training takes its share along, as a GPU cell takes its
devices. Before 2026-12-07 the cells shared the cores, so a switch moved no hardware.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from scheduler.policy import make_policy
from sim.calibrate import BATCH_COST, MeasuredRun, calibrate, load_measured, on_hosts, predict, save_measured

SCHEDULES: dict[str, dict[str, Any]] = {
    "colocate": {"policy": "colocate"},
    "async": {"policy": "async", "params": {"train_cells": 1}},
    # gain_factor 0: move whenever capacity allows (the controller estimates no backlog in seconds yet);
    # lend_core: the core's cell rolls out too until the step being trained reaches its tail (a step's
    # training is a small share of it here: a core that always trains idles)
    "elastic": {
        "policy": "elastic",
        "params": {"depth": 2, "min_dwell_s": 1.0, "gain_factor": 0.0, "lend_core": True},
    },
}
CELL_CPUS = 0.4
"""Each cell's CPU quota on its host, the core's too: 1.6 of this machine's 2 cores, the rest to the
gateway, the harnesses, the scheduler's controller, Prefect and S3."""
WORKLOAD: dict[str, Any] = {
    "max_policy_lag": 1,
    "dispatch": {"durations": {"short_turns": 2, "long_fraction": 0.34, "long_factor": [3.0, 5.0]}},
    "cluster": {"cell_cpus": CELL_CPUS},
}
"""A third of the executions run 3-5 times as many turns: the tail that elastic moves cells away from.
Each cell owns its CPU share (a cgroup quota on its host): a cell idle in rollout wastes its share, a
cell switched to training brings it to the step."""
ROUNDS = 2
MEASURED = Path("bench/results/hosts-measured.json")
"""The runs the simulator's prediction used: the 1-host calibration runs and each policy's last round."""
DEPTH = {"colocate": 1, "async": 2, "elastic": 2}


def _run(
    cells: list[int], schedule: str, workload: dict[str, Any] = WORKLOAD, **more: Any
) -> tuple[dict[str, Any], Any]:
    from bench.cluster import campaign_on_hosts

    with tempfile.TemporaryDirectory(prefix=f"gyre-bench-hosts-{schedule}-") as tmp:
        row = campaign_on_hosts(
            Path(tmp), cells, heartbeat_misses=5, scheduler=SCHEDULES[schedule], overrides=workload, **more
        )
    row.pop("cell_runs")
    measured = dataclasses.replace(row.pop("measured"), makespan_s=row["steps_span_s"], policy=schedule)
    return row, measured


def _shown(row: dict[str, Any]) -> str:
    return (
        f"span {row['steps_span_s']:6.1f} s  steps {row['step_s']} s  switches {row['switches_by_step']}  "
        f"replica micro-batches {row['micro_batches_off_core']}  lost {row['executions_lost']}  trained "
        f"twice {row['trained_twice']}  held-out {row['held_out'].get('mean_reward')}"
    )


def schedules_across_hosts(
    rounds: int = ROUNDS,
    delivery: dict[str, Any] | None = None,
    progress: Path | None = None,
    measured_out: Path = MEASURED,
) -> dict[str, Any]:
    """The three policies' rows on three hosts (``rounds`` rounds), elastic with h3 cut, and the
    simulator's prediction of each row calibrated on one host (``delivery``: train.weight_delivery's
    figures, the link rate; None: the links left out; ``progress``: a file the rows are written to
    before the cut and the calibration run)."""
    spans: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in SCHEDULES}
    measured: dict[str, Any] = {}
    for round_ in range(rounds):
        for name in SCHEDULES:
            row, measured[name] = _run([1, 1, 1], name)
            spans[name].append(row["steps_span_s"])
            rows[name].append(row)
            print(f"elastic     round {round_ + 1} {name:<9} {_shown(row)}", flush=True)
    mean = {name: sum(v) / len(v) for name, v in spans.items()}
    if progress is not None:  # the rows so far, should a later run fail
        progress.write_text(json.dumps({"rounds": spans, "rows": rows}, indent=1, default=str) + "\n")
    # the cut comes once h3's cell holds sessions of step 0, and four steps leave the fleet time to
    # start its cell again while the run goes on (about 40 s here): cut in step 1 of two, a run whose
    # steps take 10-20 s had ended first, with nothing left for the scheduler to follow it in
    cut, _ = _run([1, 1, 1], "elastic", {**WORKLOAD, "max_policy_lag": 0, "steps": 4}, cut="h3", cut_step=0)
    print(f"elastic     cut h3    {_shown(cut)}  moved {cut['moved']}", flush=True)
    one, calibration = _run([3], "colocate")
    print(f"elastic     1 host    colocate (the simulator's calibration) {_shown(one)}", flush=True)
    one_async, streaming = _run([3], "async")
    print(f"elastic     1 host    async (the simulator's training rate) {_shown(one_async)}", flush=True)
    runs = {"calibration": [calibration], "streaming": [streaming]} | {n: [r] for n, r in measured.items()}
    save_measured(runs, str(measured_out))
    from bench.batch_cost import batch_cost

    cost = batch_cost(CELL_CPUS)
    print(f"elastic     batch cost on a cell of {CELL_CPUS} cores {cost}", flush=True)
    try:
        sim = sim_rows(calibration, measured, delivery, streaming, cost["batch_cost"])
    except Exception as error:  # the rows measured stay; the prediction says why it is missing
        sim = {"error": f"{type(error).__name__}: {error}", "rows": {}}
    figures = {
        "hosts": 3,
        "rounds": {name: spans[name] for name in SCHEDULES},
        "span_s_mean": {name: round(m, 2) for name, m in mean.items()},
        "speedup_vs_async": round(mean["async"] / mean["elastic"], 3),
        "speedup_vs_colocate": round(mean["colocate"] / mean["elastic"], 3),
        "held_out": {name: [r["held_out"] for r in rows[name]] for name in SCHEDULES},
        "rows": rows,
        "cut": {
            k: cut[k]
            for k in ("executions_lost", "trained_twice", "calls_recorded_twice", "moved", "recovery_s")
        }
        | {"cells_moved": sum(cut["cells_moved_by_step"])},
        "batch_cost": cost,
        "sim": sim,
        "sim_vs_real_error": max((r["error"] for r in sim["rows"].values()), default=None),
    }
    print(
        f"elastic     speedup vs async {figures['speedup_vs_async']}  vs colocate "
        f"{figures['speedup_vs_colocate']}  (span means {figures['span_s_mean']})  sim error "
        f"{figures['sim_vs_real_error']}",
        flush=True,
    )
    return figures


def sim_rows(
    one: MeasuredRun,
    rows: dict[str, MeasuredRun],
    delivery: dict[str, Any] | None,
    streaming: MeasuredRun | None = None,
    batch_cost: float = BATCH_COST,
) -> dict[str, Any]:
    """The simulator calibrated on the 1-host colocate run ``one`` (and the 1-host async run
    ``streaming``, its training rate and update, where it measured its core's compute: runs saved
    before 2026-12-07 22:00 did not; ``batch_cost``: a cell's decode cost per sequence,
    bench/batch_cost.py) predicting each 3-host row's span (the last round's) under its policy."""
    stream = None
    if streaming is not None and sum(streaming.core_compute_s) > 0:  # its core's training rate measured
        stream = (streaming, make_policy("async", **SCHEDULES["async"]["params"]), DEPTH["async"])
    machine = calibrate(
        one, make_policy("colocate"), 3, one.sessions_per_cell, streaming=stream, batch_cost=batch_cost
    )
    if delivery is not None:
        machine = on_hosts(machine, 3, 1, delivery["bytes"], delivery["bytes"] / delivery["other_host_s"])
    predicted = {
        name: predict(machine, run, make_policy(name, **SCHEDULES[name].get("params", {})), DEPTH[name])
        for name, run in rows.items()
    }
    return {
        "calibrated_on": "1 host, colocate" + (" and async" if stream is not None else ""),
        "batch_cost": batch_cost,
        "span_s_1_host": round(one.makespan_s, 2),
        "rows": {
            name: {
                "predicted_s": round(p, 2),
                "measured_s": round(rows[name].makespan_s, 2),
                "error": round(abs(p - rows[name].makespan_s) / rows[name].makespan_s, 4),
            }
            for name, p in predicted.items()
        },
    }


def sim_again(measured: Path, hosts: Path | None, update: bool) -> dict[str, Any]:
    """The prediction from the runs a benchmark saved (``measured``), with the link rate and the batch
    cost of its ``hosts`` report (``gyre bench hosts``' hosts.json: train.weight_delivery,
    elastic.batch_cost; a report without a batch cost has it measured now and kept in it). ``update``:
    the report's elastic.sim and sim_vs_real_error are replaced by this prediction."""
    runs = load_measured(str(measured))
    one, streaming = runs.pop("calibration")[0], runs.pop("streaming", [None])[0]
    report = json.loads(hosts.read_text()) if hosts is not None else {}
    elastic = report.get("elastic", {})
    if hosts is not None and "batch_cost" not in elastic:
        from bench.batch_cost import batch_cost

        elastic["batch_cost"] = batch_cost(CELL_CPUS)
    cost = elastic.get("batch_cost", {}).get("batch_cost", BATCH_COST)
    link = report.get("train", {}).get("weight_delivery")
    sim = sim_rows(one, {n: r[0] for n, r in runs.items()}, link, streaming, cost)
    if update and hosts is not None:
        elastic["sim"] = sim
        elastic["sim_vs_real_error"] = max(r["error"] for r in sim["rows"].values())
        hosts.write_text(json.dumps(report | {"elastic": elastic}, indent=1) + "\n")
    return sim


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rounds", nargs="?", type=int, default=ROUNDS)
    parser.add_argument("out", nargs="?", default="bench/results/hosts_elastic.json")
    parser.add_argument("--sim", type=Path, default=None, help="predict again from these saved runs only")
    parser.add_argument("--hosts", type=Path, default=None, help="with --sim: the hosts.json of those runs")
    parser.add_argument("--update", action="store_true", help="with --hosts: write the prediction into it")
    args = parser.parse_args()
    if args.sim is not None:
        print(json.dumps(sim_again(args.sim, args.hosts, args.update), indent=1))
    else:
        result = schedules_across_hosts(args.rounds, progress=Path(args.out).with_suffix(".partial.json"))
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
