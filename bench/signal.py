"""`python -m bench.signal`: how much GRPO signal the shipped warm start gives, per sampling
temperature and group size, on validation problems (generator seed 20000: neither the held-out
problems of `gyre bench learn`, seed 0, nor the warm start's demonstrations, seeds 1000-1002, nor a
campaign's training problems, seed 5000 + step).

A group whose rewards are all equal has zero advantage everywhere and trains nothing; the fraction
of groups with mixed rewards is the fraction of a step that teaches. For each temperature, the
warm start rolls out ``problems`` validation problems in groups of ``group_size`` (the rollout
settings of configs/learn.toml otherwise), and the figures are counted per group size by taking the
first k members of each group (k = 2, 4, ..., group_size), so one rollout answers every smaller size.

    python -m bench.signal [--problems 12] [--group-size 8] [--temperatures 1.0,1.3,1.6]
                           [--suites repo,swe] [--difficulty 2]

Figures go to bench/results/signal.json: per temperature, the pass rate over every execution,
per suite and per kind of problem (a terminal problem's operations), the mean reward and, per group
size, the groups with mixed rewards and their fraction. Temperature 0 is greedy decoding, as the
held-out evaluations decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

from bench.figures import write_figures
from environments.dispatch import dispatch_missing
from flows.config import CampaignConfig
from stack.stack import local_stack
from tasks.campaign import problems_for
from trajectory_store.storage import StoreConfig

VALIDATION_SEED = 20000
DEFAULT_OUT = "bench/results/signal.json"


def mixed_fraction(rewards_by_problem: dict[str, list[float]], k: int) -> tuple[int, float]:
    """Groups (the first k members of each) whose rewards are not all equal, and their fraction."""
    groups = [rewards[:k] for rewards in rewards_by_problem.values() if len(rewards) >= k]
    mixed = sum(len(set(group)) > 1 for group in groups)
    return mixed, mixed / len(groups) if groups else 0.0


def _kind(problem) -> str:
    """The suite, and for a terminal problem its operations (create, rename, ...): which kinds of
    problem the policy solves, and which it never does (those give no signal at any group size)."""
    operations = problem.meta.get("operations")
    return f"{problem.suite}:{'+'.join(operations)}" if operations else problem.suite


def measure(
    config: CampaignConfig, problems: int, group_size: int, temperature: float, root: str
) -> dict[str, Any]:
    chosen = problems_for(
        list(config.problems.suites),
        problems,
        VALIDATION_SEED,
        config.problems.difficulty,
        config.problems.length,
    )
    dispatch = replace(
        config.dispatch,
        group_size=group_size,
        harness=replace(config.dispatch.harness, temperature=temperature),
        workspace_root=f"{root}/ws-{temperature}",
        campaign=f"signal-{temperature}",
    )
    store = StoreConfig(data_root=f"{root}/store", campaign=f"signal-{temperature}")
    started = time.monotonic()
    with local_stack(config.policy, store, engines=config.serving.engines, dtype="float32") as stack:
        outcomes, _ = asyncio.run(
            dispatch_missing(chosen, stack.gateway_url, stack.admin_token, store, dispatch)
        )
    rewards: dict[str, list[float]] = defaultdict(list)
    for outcome in sorted(outcomes, key=lambda o: o.execution_id):
        rewards[outcome.problem_id].append(outcome.reward or 0.0)
    passed = sum(r == 1.0 for values in rewards.values() for r in values)
    executions = sum(len(values) for values in rewards.values())
    mean_reward = sum(r for values in rewards.values() for r in values) / max(executions, 1)
    by_suite: dict[str, list[float]] = defaultdict(list)
    for problem_id, values in rewards.items():
        by_suite[problem_id.split("-")[0]].extend(values)
    kind_of = {p.problem_id: _kind(p) for p in chosen}
    by_kind: dict[str, list[float]] = defaultdict(list)
    for problem_id, values in rewards.items():
        by_kind[kind_of[problem_id]].extend(values)
    by_size = {}
    for k in range(2, group_size + 1, 2):
        mixed, fraction = mixed_fraction(rewards, k)
        by_size[str(k)] = {"groups_mixed": mixed, "fraction_mixed": round(fraction, 3)}
    return {
        "temperature": temperature,
        "executions": executions,
        "pass_rate": round(passed / max(executions, 1), 3),
        "mean_reward": round(mean_reward, 3),
        "pass_rate_by_suite": {
            suite: round(sum(r == 1.0 for r in values) / len(values), 3)
            for suite, values in sorted(by_suite.items())
        },
        "pass_rate_by_kind": {
            kind: round(sum(r == 1.0 for r in values) / len(values), 3)
            for kind, values in sorted(by_kind.items())
        },
        "executions_by_kind": {kind: len(values) for kind, values in sorted(by_kind.items())},
        "by_group_size": by_size,
        "minutes": round((time.monotonic() - started) / 60, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/learn.toml", help="the rollout settings and policy")
    parser.add_argument("--problems", type=int, default=12)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperatures", default="1.0,1.3,1.6")
    parser.add_argument("--suites", default=None, help="comma-separated (default: the config's)")
    parser.add_argument("--difficulty", type=int, default=None, help="default: the config's")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    config = CampaignConfig.from_toml(args.config)
    problems: dict = {}
    if args.suites:
        problems["suites"] = args.suites.split(",")
    if args.difficulty:
        problems["difficulty"] = args.difficulty
    config = config.merged({"problems": problems})
    results = []
    with tempfile.TemporaryDirectory(prefix="gyre-signal-") as root:
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            results.append(measure(config, args.problems, args.group_size, temperature, root))
            print(json.dumps(results[-1]), flush=True)
    print(
        f"{'temperature':>11} {'pass rate':>9} "
        + " ".join(f"{'mixed G=' + k:>10}" for k in results[0]["by_group_size"])
    )
    for row in results:
        cells = " ".join(f"{v['fraction_mixed']:>10.3f}" for v in row["by_group_size"].values())
        print(f"{row['temperature']:>11} {row['pass_rate']:>9.3f} {cells}")
    print(
        f"{'kind':<20} {'executions':>10} " + " ".join(f"{'T=' + str(r['temperature']):>8}" for r in results)
    )
    for kind, count in results[0]["executions_by_kind"].items():
        rates = " ".join(f"{r['pass_rate_by_kind'][kind]:>8.3f}" for r in results)
        print(f"{kind:<20} {count:>10} {rates}")
    figures = {
        "config": args.config,
        "policy": config.policy,
        "suites": list(config.problems.suites),
        "difficulty": config.problems.difficulty,
        "validation_seed": VALIDATION_SEED,
        "problems": args.problems,
        "group_size": args.group_size,
        "rows": results,
    }
    write_figures(figures, args.out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
