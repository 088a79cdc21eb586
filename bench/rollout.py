"""`gyre bench rollout [--quick]`: agent executions end to end on this machine.

A local stack (one rollout engine process, the gateway) serves the policy (a fresh tiny model unless
--model is given); the dispatcher runs executions of the three suites with heavy-tailed turn budgets
(most short, a fraction 10-50x longer) and a deadline that the long ones hit, so timeouts are graded
from their workspace snapshots. The same problems are also run with concurrency 1 as the baseline for
the dispatcher's concurrency, and once more with a fresh interpreter per harness instead of the
zygote's forks (``harness_zygote = False``), for what the zygote saves; that run goes last, so the
engine's prefix cache favours it, never the zygote. Then DuckDB reads the recorded trees.

Figures (bench/results/rollout.json): executions_per_minute (and the sequential baseline and their
ratio), calls, tokens as sent and unique (naive_over_unique_tokens), summaries / sub-agents /
branches, executions_per_minute_fresh_interpreter and zygote_speedup, timeouts_graded,
sandbox_violations_blocked (refusals during the executions plus a fixed
set of escape probes run against the sandbox: every probe must be blocked).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict
from typing import Any

from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.harness import HarnessConfig
from environments.sandbox import Sandbox, SandboxLimits, SandboxViolation
from stack.stack import local_stack
from tasks.rollout import choose_problems, run_rollout, summarize_outcomes
from trajectory_store.config import SelectionConfig
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig

DEFAULT_OUT = "bench/results/rollout.json"
SIZES = {
    True: {"problems": 12, "baseline": 4, "concurrency": 4, "timeout_s": 40.0, "short_turns": 2},
    False: {"problems": 36, "baseline": 8, "concurrency": 6, "timeout_s": 60.0, "short_turns": 3},
}


def _dispatch_config(
    size: dict[str, Any], concurrency: int, step: int, zygote: bool = True
) -> DispatchConfig:
    return DispatchConfig(
        step=step,
        concurrency=concurrency,
        harness_zygote=zygote,
        timeout_s=size["timeout_s"],
        durations=DurationProfile(short_turns=size["short_turns"], long_fraction=0.25),
        harness=HarnessConfig(max_tokens=96, context_budget_tokens=1200, summary_max_tokens=64),
    )


def sandbox_probes(root: str) -> dict[str, Any]:
    """Escape attempts against a fresh sandbox; each is either blocked or reported as not blocked."""
    sandbox = Sandbox.create(root, "probe", {"ok.txt": "fine\n"}, SandboxLimits(cpu_s=2, command_wall_s=5))
    outside = os.path.join(root, "outside.txt")
    os.symlink("/etc", sandbox.workspace / "etc-link")
    blocked: dict[str, bool] = {}

    def refused(action) -> bool:
        try:
            action()
        except SandboxViolation:
            return True
        return False

    blocked["read ../"] = refused(lambda: sandbox.read_file("../outside.txt"))
    blocked["read absolute"] = refused(lambda: sandbox.read_file("/etc/passwd"))
    blocked["write absolute"] = refused(lambda: sandbox.write_file(outside, "x"))
    blocked["write through symlink"] = refused(lambda: sandbox.write_file("etc-link/gyre-probe", "x"))
    network = sandbox.run(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\"", timeout_s=10
    )
    blocked["network"] = network.returncode != 0
    hog = sandbox.run("python3 -c 'while True: pass'", timeout_s=30)
    blocked["cpu"] = hog.limit in ("cpu", "wall")
    sleeper = sandbox.run("sleep 60", timeout_s=1)
    blocked["wall clock"] = sleeper.timed_out
    return {"blocked": sum(blocked.values()), "total": len(blocked), "probes": blocked}


def run(quick: bool, model: str | None = None) -> dict[str, Any]:
    size = SIZES[quick]
    with tempfile.TemporaryDirectory(prefix="gyre-bench-rollout-") as tmp:
        if model is None:
            from tasks.model import init_model

            model = f"{tmp}/policy"
            init_model.fn("tiny", model)
        store = StoreConfig(data_root=f"{tmp}/store", campaign="bench")
        problems = choose_problems("mixed", size["problems"], seed=0)
        with local_stack(model, store, max_batch_size=8) as stack:
            started = time.perf_counter()
            outcomes = run_rollout(
                problems,
                stack.gateway_url,
                stack.admin_token,
                store,
                _dispatch_config(size, size["concurrency"], 0),
            )
            wall_s = time.perf_counter() - started
            baseline = problems[: size["baseline"]]
            started = time.perf_counter()
            sequential = run_rollout(
                baseline, stack.gateway_url, stack.admin_token, store, _dispatch_config(size, 1, 1)
            )
            sequential_s = time.perf_counter() - started
            started = time.perf_counter()
            fresh = run_rollout(
                problems,
                stack.gateway_url,
                stack.admin_token,
                store,
                _dispatch_config(size, size["concurrency"], 2, zygote=False),
            )
            fresh_s = time.perf_counter() - started
        con = connect(Store(store), SelectionConfig())
        main_run = [o.execution_id for o in outcomes]  # not the sequential baseline's (step 1)
        naive, unique, calls = con.execute(
            "SELECT sum(n_naive_tokens), sum(n_unique_tokens), sum(n_calls) FROM execution_stats "
            "WHERE execution_id IN (SELECT unnest($1))",
            [main_run],
        ).fetchall()[0]
        roles = dict(
            con.execute(
                "SELECT role, count(*) FROM calls WHERE execution_id IN (SELECT unnest($1)) GROUP BY role",
                [main_run],
            ).fetchall()
        )
        probes = sandbox_probes(tmp)
    summary = summarize_outcomes(outcomes)
    concurrent_rate = len(outcomes) / wall_s * 60
    sequential_rate = len(sequential) / sequential_s * 60
    fresh_rate = len(fresh) / fresh_s * 60
    return {
        "quick": quick,
        "model": "fresh tiny (random init)" if model.startswith(tmp) else model,
        "executions": len(outcomes),
        "concurrency": size["concurrency"],
        "deadline_s": size["timeout_s"],
        "wall_s": round(wall_s, 2),
        "executions_per_minute": round(concurrent_rate, 2),
        "sequential_executions_per_minute": round(sequential_rate, 2),
        "concurrent_over_sequential": round(concurrent_rate / sequential_rate, 2),
        "executions_per_minute_fresh_interpreter": round(fresh_rate, 2),
        "zygote_speedup": round(concurrent_rate / fresh_rate, 2),
        "by_status": summary["by_status"],
        "mean_reward": round(summary["mean_reward"], 4),
        "pass_rate": round(summary["pass_rate"], 4),
        "calls": int(calls or 0),
        "calls_by_role": roles,
        "tokens_as_sent": int(naive or 0),
        "unique_tokens": int(unique or 0),
        "naive_over_unique_tokens": round(naive / unique, 3) if unique else None,
        "branches": summary["branches"],
        "summaries": sum(o.summaries for o in outcomes),
        "subagents": sum(o.subagents for o in outcomes),
        "turn_budgets": sorted(o.turn_budget or 0 for o in outcomes),
        "timeouts_graded": summary["timeouts_graded"],
        "sandbox_violations_in_executions": summary["sandbox_violations_blocked"],
        "sandbox_probes": probes,
        "sandbox_violations_blocked": summary["sandbox_violations_blocked"] + probes["blocked"],
        "outcomes": [asdict(o) for o in outcomes],
    }


def main(quick: bool = False, out: str = DEFAULT_OUT, model: str | None = None) -> int:
    figures = run(quick, model)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as handle:
        json.dump(figures, handle, indent=1)
    print(f"model                          {figures['model']}")
    print(f"executions                     {figures['executions']} ({figures['by_status']})")
    print(
        f"executions per minute          {figures['executions_per_minute']} at concurrency "
        f"{figures['concurrency']} vs {figures['sequential_executions_per_minute']} sequential "
        f"({figures['concurrent_over_sequential']}x)"
    )
    print(
        f"with a fresh interpreter each  {figures['executions_per_minute_fresh_interpreter']} per minute "
        f"(the zygote's forks: {figures['zygote_speedup']}x)"
    )
    print(f"calls                          {figures['calls']} {figures['calls_by_role']}")
    print(
        f"tokens as sent / unique        {figures['tokens_as_sent']} / {figures['unique_tokens']} "
        f"= {figures['naive_over_unique_tokens']}x"
    )
    print(
        f"branches / summaries / subs    {figures['branches']} / {figures['summaries']} / {figures['subagents']}"
    )
    print(f"turn budgets                   {figures['turn_budgets']}")
    print(f"timeouts graded from snapshots {figures['timeouts_graded']}")
    probes = figures["sandbox_probes"]
    print(
        f"sandbox violations blocked     {figures['sandbox_violations_blocked']} "
        f"({figures['sandbox_violations_in_executions']} in executions, probes {probes['blocked']}/{probes['total']})"
    )
    print(f"mean reward / pass rate        {figures['mean_reward']} / {figures['pass_rate']}")
    print(f"wrote {out}")
    return 0
