"""xLong for real (issue 37): one execution that touches up to a million tokens, end to end.

    gyre bench xlong            # executions touching 64K, 256K and 1M tokens
    gyre bench xlong --quick    # 64K and 256K
    python -m bench.xlong [--quick] [--sizes 65536,262144] [--out bench/results/xlong.json]
    gyre bench xlong --only snapshot   # the snapshot stage alone, for every size of --out

Per size, one group of two executions runs through the real stack (stack/stack.py: one
rollout engine process, two torch threads, and the gateway, which records every call to Parquet):

- the xLong execution, a scripted harness (``drive``) on the official ``openai`` client. Its main
  agent reads large files until its context passes ``CONTEXT_SHARE`` of the tokens to touch (134K
  at 1M), in ``BIG_READS`` tool outputs; compresses it with a summary call (role main_summary: the
  conversation starts again from the summary, a new root); then works in small turns (tool outputs
  of 60-2,000 tokens, lognormal), each followed by a sub-agent of 6-12 turns in its own context
  (its own tree), until the tokens touched reach the size. Every ``BRANCH_EVERY``-th main turn is
  asked twice with different seeds (a retry: a branch in the tree). Tokens touched = the sum of
  every call's prompt and completion tokens, as the gateway's usage reports them.
- a short sibling execution of the same problem (reward 0 against the xLong one's 1), so the group
  has a signal and the loss a gradient. The harness is scripted, not graded: the rewards are fixed.

Each later stage runs in a process of its own, so its peak resident memory (``ru_maxrss``) is its
own: ``tree`` (the DuckDB views: tree nodes, trajectories, role-priority selection, training
tokens, with DuckDB's memory_limit set to ``DUCKDB_MEMORY_LIMIT`` and a spill folder, through
StoreConfig). The selection takes every trajectory (j_max ``SELECT_ALL``), so the training tree is
the whole execution; what the default selection (j_max 5, main > sub > main_summary) would train is
reported beside it (``default_selection_*``): it leaves out the context a summary compressed, whose
leaf is the summary call. Then ``pack``
(trajectory_store.processor.pack into sequences of at most max(longest path + 1, ``PIECE_BUDGET``)
tokens: a tree larger than that is split into pieces that repeat the ancestors they need, as
context only), ``train`` (the trainer's own GradWorker: forward and backward of every packed
sequence with the tree kernel), ``snapshot`` (a workspace of ``SNAPSHOT_BYTES_PER_TOKEN`` a token
touched stored as snapshot rows and blobs, then written back as the grader does). The rollout's
memory is read from the engine's and the gateway's /proc VmHWM (the gateway's is the recording's:
it streams calls to Parquet parts).

Across sizes: each stage's growth exponent of time and of memory (log-log slope from the smallest
to the largest size). On the smallest size's group: the tree loss and gradient trained in one piece
against the same trees trained in pieces (``piecewise_*_rel_diff``).

Pieces: bench/xlong_workload.py (the policy copy and the scripted harness), bench/xlong_stages.py
(each stage, in a process of its own); this module runs them per size and sums them up. The names
tests/test_xlong.py reaches as xlong.* are imported here again (``import X as X``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.xlong_stages import ENGINE_THREADS, _stage_main, run_stage
from bench.xlong_stages import stage_piecewise as stage_piecewise
from bench.xlong_stages import stage_snapshot as stage_snapshot
from bench.xlong_stages import stage_tree as stage_tree
from bench.xlong_workload import POLICY as POLICY
from bench.xlong_workload import Texts as Texts
from bench.xlong_workload import policy_copy as policy_copy
from bench.xlong_workload import run_group as run_group
from trajectory_store.storage import Store, StoreConfig

DEFAULT_OUT = "bench/results/xlong.json"
SIZES = (65_536, 262_144, 1_048_576)
QUICK_SIZES = SIZES[:2]
SNAPSHOT_BYTES_PER_TOKEN = 512  # the timed-out workspace snapshotted: about 0.5-0.65 GB at 1M touched


def stored_bytes(work: str, unique: int, policy: int) -> dict[str, Any]:
    """Bytes of the stored calls over 4 B per unique token id + 4 B per policy logprob."""
    store = Store(StoreConfig(data_root=os.path.join(work, "store"), campaign="xlong"))
    table = store.read_table("calls")
    parquet = sum(store.fs.size(p) for p in store.visible_parts("calls"))
    floor = 4 * unique + 4 * policy
    return {
        "stored_bytes": table.nbytes,
        "parquet_bytes": parquet,
        "stored_over_unique": table.nbytes / floor,
        "parquet_over_unique": parquet / floor,
    }


def run_size(goal: int, root: str, seed: int, piecewise: bool) -> dict[str, Any]:
    work = os.path.join(root, f"touched-{goal}")
    os.makedirs(work, exist_ok=True)
    started = time.perf_counter()
    figures: dict[str, Any] = {"goal_tokens_touched": goal}
    stages = {"rollout": run_stage("rollout", work, goal, seed)}
    for name in ("tree", "pack", "train", "snapshot"):
        args = [goal * SNAPSHOT_BYTES_PER_TOKEN] if name == "snapshot" else []
        stages[name] = run_stage(name, work, *args)
        print(
            f"  {goal:>9,} {name:<8} {stages[name]['s']:8.1f} s  {stages[name]['peak_rss_gb']:6.2f} GB",
            flush=True,
        )
    rollout = stages["rollout"]
    figures.update(
        tokens_touched=rollout["tokens_touched"],
        calls=rollout["calls"],
        max_context_tokens=rollout["max_context_tokens"],
        unique_tokens=stages["tree"]["unique_tokens"],
        unique_over_touched=stages["tree"]["unique_tokens"] / rollout["group_tokens_touched"],
        **stored_bytes(work, stages["tree"]["unique_tokens"], stages["tree"]["policy_tokens"]),
        stages=stages,
    )
    # the recording runs in the gateway (it streams calls to Parquet parts): its process is the store stage
    stages["store"] = {"s": rollout["s"], "peak_rss_gb": rollout["gateway_peak_rss_gb"]}
    stages["engine"] = {"s": rollout["s"], "peak_rss_gb": rollout["engine_peak_rss_gb"]}
    if piecewise:
        figures["piecewise"] = run_stage("piecewise", work)
    figures["wall_s"] = time.perf_counter() - started
    shutil.rmtree(os.path.join(work, "store"), ignore_errors=True)
    return figures


def add_snapshots(out: str) -> dict[str, Any]:
    """The snapshot stage alone for every size of an existing result file, its rows replaced."""
    figures = json.loads(Path(out).read_text())
    with tempfile.TemporaryDirectory(prefix="gyre-xlong-") as root:
        for size in figures["sizes"]:
            work = os.path.join(root, f"touched-{size['goal_tokens_touched']}")
            os.makedirs(work)
            size["stages"]["snapshot"] = run_stage(
                "snapshot", work, size["goal_tokens_touched"] * SNAPSHOT_BYTES_PER_TOKEN
            )
    return _summarized(figures["sizes"], figures)


def _summarized(results: list[dict[str, Any]], figures: dict[str, Any]) -> dict[str, Any]:
    """The cross-size figures: peak memory per stage and size, growth exponents."""
    figures["peak_rss_gb"] = {
        stage: {str(r["goal_tokens_touched"]): r["stages"][stage]["peak_rss_gb"] for r in results}
        for stage in results[-1]["stages"]
    }
    figures["growth"] = growth(results)
    return figures


def growth(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage, the log-log slope of time and of peak memory over tokens touched (smallest to largest)."""
    if len(sizes) < 2:
        return {}
    first, last = sizes[0], sizes[-1]
    span = math.log(last["tokens_touched"] / first["tokens_touched"])
    out = {}
    for stage in last["stages"]:
        a, b = first["stages"][stage], last["stages"][stage]
        out[stage] = {
            "time_exponent": math.log(b["s"] / a["s"]) / span,
            "memory_exponent": math.log(b["peak_rss_gb"] / a["peak_rss_gb"]) / span,
        }
    return out


def summary_lines(f: dict[str, Any]) -> list[str]:
    lines = []
    for size in f["sizes"]:
        s = size["stages"]
        lines.append(
            f"touched {size['tokens_touched']:>9,} ({size['calls']} calls, context up to "
            f"{size['max_context_tokens']:,}, unique {size['unique_tokens']:,}, stored/unique "
            f"{size['stored_over_unique']:.3f}x)"
        )
        for name in ("engine", "store", "tree", "pack", "train", "snapshot"):
            if name in s:
                lines.append(f"  {name:<8} {s[name]['s']:9.1f} s  peak {s[name]['peak_rss_gb']:6.2f} GB")
    for name, g in f["growth"].items():
        lines.append(f"growth {name:<7} time ^{g['time_exponent']:.2f}  memory ^{g['memory_exponent']:.2f}")
    p = f.get("piecewise")
    if p:
        lines.append(
            f"piecewise: {p['pieces']} pieces vs {p['one_piece_sequences']}: loss rel diff "
            f"{p['loss_rel_diff']:.2e}, grad rel diff {p['grad_rel_diff']:.2e}"
        )
    return lines


def run(sizes: list[int], seed: int = 0) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gyre-xlong-") as root:
        results = []
        for i, goal in enumerate(sizes):
            print(f"xlong: touching {goal:,} tokens", flush=True)
            results.append(run_size(goal, root, seed, piecewise=i == 0))
    figures = {
        "max_tokens_touched": max(r["tokens_touched"] for r in results),
        "max_context_tokens": max(r["max_context_tokens"] for r in results),
        "piecewise_loss_rel_diff": results[0]["piecewise"]["loss_rel_diff"],
        "piecewise_grad_rel_diff": results[0]["piecewise"]["grad_rel_diff"],
        "piecewise": results[0]["piecewise"],
        "stored_over_unique": results[-1]["stored_over_unique"],
        "stored_over_unique_smallest": results[0]["stored_over_unique"],
        "sizes": results,
        "engine_threads": ENGINE_THREADS,
        "machine": {"cpus": os.cpu_count()},
        "wall_s": time.perf_counter() - started,
    }
    return _summarized(results, figures)


def main(quick: bool = False, out: str = DEFAULT_OUT, sizes: list[int] | None = None, only: str = "") -> int:
    if only not in ("", "snapshot"):
        raise SystemExit(
            f"--only {only!r}: the one stage that can run alone on an existing --out is 'snapshot'"
        )
    figures = add_snapshots(out) if only else run(sizes or list(QUICK_SIZES if quick else SIZES))
    for line in summary_lines(figures):
        print(line)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    Path(out).write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", help="tokens touched, comma-separated (default: 64K, 256K, 1M)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--only", default="", help="'snapshot': that stage alone, for every size of --out")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    cli, rest = parser.parse_known_args()
    if cli.stage:
        sys.exit(_stage_main(cli.stage, cli.work, cli.result, rest))
    sys.exit(
        main(cli.quick, cli.out, [int(s) for s in cli.sizes.split(",")] if cli.sizes else None, cli.only)
    )
