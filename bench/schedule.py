"""The scheduling benchmark: elastic against colocate and a tuned async split, in simulation at
paper scale and for real on this machine's CPU, in one invocation.

    gyre bench schedule                          # every preset (48 steps) + the real runs (~15 min)
    gyre bench schedule --quick                  # short campaigns + short real runs (~7 min)
    gyre bench schedule --sim-only [--preset paper-flagship]   # simulation alone (seconds)
    python -m bench.schedule [--quick] [--sim-only] [--preset NAME] [--out bench/results/schedule.json]

The real part (bench/schedule_real.py): the three policies on the same problems and the same four
cells, then the simulator calibrated on a colocate and an async run of other problems predicting each real
makespan (sim_vs_real_error).

Every policy runs on the SAME sampled work (one seed per preset) and the same cells
(sim/presets.py documents each preset's assumptions). Rows:
- colocate: the whole pool flips between rollout and training (synchronous, lag 0).
- async: a static split with one step of overlap (lag <= 1). Honest baseline: every split in the
  preset's `async_splits` is run and the fastest is reported, with its split.
- elastic: the waterlevel policy with two steps in flight (lag <= 1, as async), the core lent to
  rollout while a step rolls out its bulk (the presets' `lend_core`; since 2026-12-06).
- elastic-core: the same with a core that always trains (the elastic row until 2026-12-05).
- elastic-sync: the waterlevel policy with one step in flight (lag 0, as colocate).
- elastic-oracle: elastic with each step's executions started longest first by their TRUE
  durations (`Preset.dispatch_order = "oracle"`): what ordering could buy, the limit of any length
  predictor; not a policy the controller can run.

- async-paperlike: the paper's async baseline (sim/baselines.py): the same static splits, the next
  batch generated and trained only once the previous one is complete; the fastest split reported.

Each row reads against its lower bound (sim/result.py `lower_bound`: work over all cells, counting
what was actually trained, and the chain of longest executions the policy's depth allows), both
terms printed. Writes JSON: presets.<name>.policies.<policy> (figures), async_split,
async_paperlike_split, elastic_over_async, elastic_over_colocate, ...; for paper-flagship the
headline paper.{colocate_h, async_paperlike_h, async_tuned_h, elastic_h, speedup_vs_async_paperlike,
speedup_vs_colocate, speedup_vs_async_tuned, over_lower_bound, bound_work_h, bound_chain_h,
bound_batch (the decode batch the work term settled on), seeds,
vs_seeds}; real.{...}, sim_vs_real_error, switch_s (the real runs). `--sim-only` writes no real
rows, so the paper figures go to bench/results/schedule-paper.json (schedule.json keeps the last
full run's real rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from scheduler.policy import AsyncConfig, make_policy
from sim.baselines import PaperAsync
from sim.presets import PRESETS, Preset, Workload, sample_workload
from sim.result import RunResult
from sim.run import simulate

DEFAULT_OUT = "bench/results/schedule.json"
QUICK_STEPS = {"paper-flagship": 4, "cpu-small": 12, "cpu-small-tail": 12}
HEADER = (
    f"{'policy':<16}{'makespan':>12}{'idle train':>12}{'idle roll':>11}{'switches':>10}{'bound':>12}"
    f"{'work':>11}{'batch':>7}{'chain':>11}{'/bound':>8}{'vs coloc':>10}{'vs async':>10}"
)
# The QwenGyre paper's flagship figures (48 steps, equal GPU budgets): what paper-flagship is
# calibrated to (colocate, async) and what it predicts (elastic).
SEEDS = {"steps": 48, "colocate_h": 91.5, "async_h": 134.6, "elastic_h": 75.4}


def _hours_or_s(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 3600 * 3 else f"{seconds:.0f} s"


def run_preset(preset: Preset) -> dict:
    """The four rows of one preset on one sampled workload."""
    work = sample_workload(preset)
    rows: dict[str, RunResult] = {"colocate": simulate(preset, make_policy("colocate"), "colocate", 1, work)}
    tried = {split: _async(preset, work, split) for split in preset.async_splits}
    best = min(tried, key=lambda split: tried[split].makespan_s)
    # the paper's async: the same static splits, no streaming across steps (sim/baselines.py)
    paperlike = {split: _paper_async(preset, work, split) for split in preset.async_splits}
    best_paperlike = min(paperlike, key=lambda split: paperlike[split].makespan_s)
    rows["async-paperlike"] = paperlike[best_paperlike]
    rows["async"] = tried[best]
    rows["elastic"] = simulate(preset, make_policy("elastic", **preset.elastic), "elastic", 2, work)
    core = {**preset.elastic, "lend_core": False}
    rows["elastic-core"] = simulate(preset, make_policy("elastic", **core), "elastic-core", 2, work)
    sync = {**preset.elastic, "depth": 1, "max_policy_lag": 0}
    rows["elastic-sync"] = simulate(preset, make_policy("elastic", **sync), "elastic-sync", 1, work)
    # what ordering a step's dispatches could buy: its executions started longest first by their
    # TRUE durations, the limit of any length predictor (Preset.dispatch_order)
    oracle = dataclasses.replace(preset, dispatch_order="oracle")
    rows["elastic-oracle"] = simulate(
        oracle, make_policy("elastic", **preset.elastic), "elastic-oracle", 2, work
    )
    colocate, async_ = rows["colocate"].makespan_s, rows["async"].makespan_s
    return {
        "steps": preset.steps,
        "cells": preset.cluster.cells,
        "devices": preset.cluster.cells * preset.cluster.devices_per_cell,
        "executions_per_step": preset.executions_per_step,
        "async_split": {"train_cells": best, "rollout_cells": preset.cluster.cells - best},
        "async_tried": {str(split): round(result.makespan_s, 1) for split, result in tried.items()},
        "async_paperlike_split": {
            "train_cells": best_paperlike,
            "rollout_cells": preset.cluster.cells - best_paperlike,
        },
        "async_paperlike_tried": {
            str(split): round(result.makespan_s, 1) for split, result in paperlike.items()
        },
        "policies": {name: row.figures() for name, row in rows.items()},
        "elastic_over_async": round(async_ / rows["elastic"].makespan_s, 4),
        "elastic_over_colocate": round(colocate / rows["elastic"].makespan_s, 4),
        "elastic_sync_over_colocate": round(colocate / rows["elastic-sync"].makespan_s, 4),
        "elastic_core_over_async": round(async_ / rows["elastic-core"].makespan_s, 4),
        "elastic_oracle_over_async": round(async_ / rows["elastic-oracle"].makespan_s, 4),
        "elastic_over_async_paperlike": round(
            rows["async-paperlike"].makespan_s / rows["elastic"].makespan_s, 4
        ),
    }


def _async(preset: Preset, work: Workload, split: int) -> RunResult:
    return simulate(preset, make_policy("async", train_cells=split), f"async-{split}", 2, work)


def _paper_async(preset: Preset, work: Workload, split: int) -> RunResult:
    """The paper's async baseline: a static split, a batch generated only once the previous one is
    complete, and trained only once it is complete."""
    policy = PaperAsync(AsyncConfig(train_cells=split), preset.group_size)
    whole_batches = dataclasses.replace(preset, stream_training=False)
    return simulate(whole_batches, policy, f"paperlike-{split}", 2, work)


def print_preset(name: str, figures: dict) -> None:
    split = figures["async_split"]
    paperlike = figures["async_paperlike_split"]
    print(
        f"\n{name}: {figures['steps']} steps, {figures['cells']} cells ({figures['devices']} devices), "
        f"{figures['executions_per_step']} executions per step; async split {split['train_cells']} train / "
        f"{split['rollout_cells']} rollout, paper-like {paperlike['train_cells']} / {paperlike['rollout_cells']} "
        f"(best of {', '.join(figures['async_tried'])})"
    )
    print(HEADER)
    policies = figures["policies"]
    for row in policies.values():
        print(
            f"{row['policy']:<16}{_hours_or_s(row['makespan_s']):>12}{row['idle_train']:>12.3f}"
            f"{row['idle_rollout']:>11.3f}{row['switches']:>10}{_hours_or_s(row['lower_bound_s']):>12}"
            f"{_hours_or_s(row['bound_work_s']):>11}{row['bound_batch']:>7.2f}{_hours_or_s(row['bound_chain_s']):>11}"
            f"{row['over_lower_bound']:>8.3f}{policies['colocate']['makespan_s'] / row['makespan_s']:>9.2f}x"
            f"{policies['async']['makespan_s'] / row['makespan_s']:>9.2f}x"
        )
    print(
        f"elastic over async {figures['elastic_over_async']:.3f}x, over colocate "
        f"{figures['elastic_over_colocate']:.3f}x (elastic-sync over colocate {figures['elastic_sync_over_colocate']:.3f}x)"
    )


def print_real(real: dict) -> None:
    print(
        f"{'policy':<10}{'makespan':>10}{'sim':>9}{'error':>8}{'switches':>10}{'train share':>13}"
        f"{'cpu busy':>10}{'reward':>8}{'held-out pass rate':>20}"
    )
    for label, row in real["policies"].items():
        sim = real["sim_vs_real"][label]
        busy = "-" if row.get("cpu_busy") is None else f"{row['cpu_busy']:.2f}"
        print(
            f"{label:<10}{row['makespan_s']:>9.1f}s{sim['sim_s']:>8.1f}s{sim['error']:>8.1%}{row['switches']:>10}"
            f"{row['role_share']['train']:>13.2f}{busy:>10}{row['mean_reward']:>8.3f}"
            f"{' / '.join(f'{x:.3f}' for x in real.get('held_out_pass_rate_by_policy', {}).get(label, [])):>20}"
        )
    if real.get("partitioned"):  # each cell's CPU use from its cgroup, in cores, cell-0 first
        cores = real.get("cpu_cores_by_policy", {})
        print(
            "cells own their CPU (a cgroup quota each); cores used per cell: "
            + "; ".join(
                f"{label} {' '.join(f'{c:.2f}' for c in by_cell.values())}"
                for label, by_cell in cores.items()
            )
        )
    elif "partitioned" in real:
        print("cells share the cores (not partitioned): an idle cell's CPU goes to the others")
    switch = real["switch_s"]
    if real.get("rounds", 1) > 1:
        print(
            f"makespans are means over {real['rounds']} rounds; per round, elastic over async "
            f"{', '.join(f'{x:.3f}x' for x in real['speedup_vs_async_rounds'])}, over colocate "
            f"{', '.join(f'{x:.3f}x' for x in real['speedup_vs_colocate_rounds'])}"
        )
    print(
        f"real: elastic over async {real['speedup_vs_async']:.3f}x, over colocate {real['speedup_vs_colocate']:.3f}x; "
        f"switch to train p50 {switch['to_train_p50']} s, to rollout p50 {switch['to_rollout_p50']} s; "
        f"sim vs real error (max) {real['sim_vs_real_error']:.1%}"
    )


def paper_figures(flagship: dict) -> dict:
    """The headline figures of paper-flagship next to the paper's (SEEDS): colocate and the
    paper-like async are calibrated to it, elastic is predicted."""
    rows = flagship["policies"]
    hours = {name: rows[name]["makespan_s"] / 3600 for name in rows}
    elastic = rows["elastic"]
    scale = SEEDS["steps"] / flagship["steps"]  # a shorter campaign is read per step
    return {
        "steps": flagship["steps"],
        "colocate_h": round(hours["colocate"], 2),
        "async_paperlike_h": round(hours["async-paperlike"], 2),
        "async_tuned_h": round(hours["async"], 2),
        "elastic_h": round(hours["elastic"], 2),
        "speedup_vs_async_paperlike": round(hours["async-paperlike"] / hours["elastic"], 4),
        "speedup_vs_colocate": round(hours["colocate"] / hours["elastic"], 4),
        "speedup_vs_async_tuned": round(hours["async"] / hours["elastic"], 4),
        "over_lower_bound": elastic["over_lower_bound"],
        # the elastic policy whose core always trains (the headline until 2026-12-05)
        "elastic_core_trains_h": round(hours["elastic-core"], 2),
        "elastic_core_trains_over_lower_bound": rows["elastic-core"]["over_lower_bound"],
        "bound_work_h": round(elastic["bound_work_s"] / 3600, 2),
        "bound_chain_h": round(elastic["bound_chain_s"] / 3600, 2),
        "bound_batch": elastic["bound_batch"],
        "async_split": flagship["async_split"],
        "async_paperlike_split": flagship["async_paperlike_split"],
        "seeds": {
            **SEEDS,
            "speedup_vs_async": round(SEEDS["async_h"] / SEEDS["elastic_h"], 4),
            "speedup_vs_colocate": round(SEEDS["colocate_h"] / SEEDS["elastic_h"], 4),
        },
        "vs_seeds": {  # simulated over the paper's figure, per step
            "colocate": round(hours["colocate"] * scale / SEEDS["colocate_h"], 4),
            "async_paperlike": round(hours["async-paperlike"] * scale / SEEDS["async_h"], 4),
            "elastic": round(hours["elastic"] * scale / SEEDS["elastic_h"], 4),
        },
        "oracle_order_over_lower_bound": rows["elastic-oracle"]["over_lower_bound"],
    }


def print_paper(paper: dict) -> None:
    seeds, vs = paper["seeds"], paper["vs_seeds"]
    print(
        f"\npaper-flagship ({paper['steps']} steps) against the paper (48 steps): colocate {paper['colocate_h']:.1f} h "
        f"(paper {seeds['colocate_h']} h, {vs['colocate']:.3f}x), paper-like async {paper['async_paperlike_h']:.1f} h "
        f"(paper {seeds['async_h']} h, {vs['async_paperlike']:.3f}x), elastic {paper['elastic_h']:.1f} h "
        f"(paper {seeds['elastic_h']} h, {vs['elastic']:.3f}x: predicted, not tuned); tuned streaming async "
        f"{paper['async_tuned_h']:.1f} h"
    )
    print(
        f"elastic {paper['speedup_vs_async_paperlike']:.3f}x paper-like async (paper {seeds['speedup_vs_async']:.3f}x), "
        f"{paper['speedup_vs_colocate']:.3f}x colocate (paper {seeds['speedup_vs_colocate']:.3f}x), "
        f"{paper['speedup_vs_async_tuned']:.3f}x tuned async; {paper['over_lower_bound']:.3f}x its lower bound "
        f"(work {paper['bound_work_h']:.1f} h at decode batch {paper['bound_batch']:.2f}, chain "
        f"{paper['bound_chain_h']:.1f} h); with a core that always trains {paper['elastic_core_trains_h']:.1f} h "
        f"({paper['elastic_core_trains_over_lower_bound']:.3f}x its bound)"
    )


def main(quick: bool = False, out: str = DEFAULT_OUT, preset: str | None = None, real: bool = True) -> int:
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    names = [preset] if preset else list(PRESETS)
    started = time.perf_counter()
    results = {}
    for name in names:
        chosen = PRESETS[name]
        if quick:
            chosen = dataclasses.replace(chosen, steps=min(chosen.steps, QUICK_STEPS.get(name, 4)))
        results[name] = run_preset(chosen)
        print_preset(name, results[name])
    report: dict = {"quick": quick}
    if "paper-flagship" in results:
        report["paper"] = paper_figures(results["paper-flagship"])
        print_paper(report["paper"])
    if real:
        from bench.schedule_real import compare  # starts engines, the gateway and replica processes

        print("\nreal: the three policies on this machine's CPU (same problems, same 4 cells)", flush=True)
        # every run's executions beside the figures: `python -m bench.schedule_real --measured FILE`
        # checks a changed simulator against them without running anything again
        measured = str(Path(out).with_name(Path(out).stem + "-measured.json"))
        report["real"] = compare(quick, measured_out=measured)
        report["real"]["measured_file"] = measured
        report["sim_vs_real_error"] = report["real"]["sim_vs_real_error"]
        report["switch_s"] = report["real"]["switch_s"]
        print_real(report["real"])
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["presets"] = results
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--preset", choices=list(PRESETS), default=None)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--sim-only", action="store_true", help="skip the real runs")
    args = parser.parse_args()
    sys.exit(main(args.quick, args.out, args.preset, real=not args.sim_only))
