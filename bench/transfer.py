"""Does what a campaign learned carry to problems it did not train on? A finer ruler than the pass rate.

`python -m bench.transfer --config C --before POLICY --after POLICY [--problems N]` scores the
reference solution of each problem (its demonstration: the conversation the built-in harness would
have had, as the warm start was trained on) under two policies, teacher-forced: the log-likelihood of
the assistant's tokens, and how many of them the policy would not choose greedily (probability <= 0.5).
It does so on two sets, each paired problem by problem:

- seen: the problems the campaign trained on (its `[problems]`: seeds `seed + step`, `per_step` each);
- unseen: validation problems (generator seed 20000, never trained on or evaluated in a campaign).

A pass flips only when a wrong token stops or starts winning; the log-likelihood moves with every
update, so a shift that is real but too small to flip a greedy answer shows here, with its sign. RL
that learns a general skill raises both sets; RL that learns its problems raises only the seen one.
Prints the mean change per problem with a paired bootstrap 95% interval and writes JSON (--out).

`--versions DIR` (a campaign's policy/ folder: v1, v2, ...) adds what each update did at once: the
change from version t to t + 1 on step t's own problems and on a few unseen ones, pooled over the
updates. An update that learns its problems raises the first; one that teaches something general,
the second too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np
import torch

from engines.model.loading import load_tokenizer
from engines.model.weights import load_model
from engines.train.sft import pack_prefix_tree, render
from engines.train.tree import target_logprobs
from environments.demos import demonstration
from environments.harness import TOOLS
from environments.problems import Problem, generate
from flows.config import CampaignConfig
from tasks.problems import step_problems
from tasks.report import paired_bootstrap

VALIDATION_SEED = 20000


def problem_sets(
    config: CampaignConfig, unseen_per_suite: int, steps: int | None
) -> dict[str, list[Problem]]:
    seen = [
        Problem.from_json(p)
        for step in range(config.steps if steps is None else steps)
        for p in step_problems(config.problems, step)
    ]
    unseen = [
        problem
        for suite in config.problems.suites
        for problem in generate(
            suite,
            unseen_per_suite,
            seed=VALIDATION_SEED,
            difficulty=config.problems.difficulty,
            length=config.problems.length,
        )
    ]
    return {"seen": seen, "unseen": unseen}


def score(policy: str, demos: list, max_len: int = 4096) -> np.ndarray:
    """Per demonstration: (sum of target logprobs, target tokens, tokens with probability <= 0.5)."""
    model = load_model(policy, dtype=torch.float32)
    model.eval()
    rows = []
    with torch.no_grad():
        for demo in demos:
            tree, _ = pack_prefix_tree([demo], max_len)
            logprobs = target_logprobs(model, tree).logprobs.double()
            rows.append((float(logprobs.sum()), len(logprobs), int((logprobs <= math.log(0.5)).sum())))
    return np.array(rows)


def paired(delta: np.ndarray) -> dict[str, float]:
    low, high = paired_bootstrap([float(d) for d in delta])
    return {"mean": float(delta.mean()), "ci95_low": low, "ci95_high": high}


def per_update(
    config: CampaignConfig, before: str, versions: str, steps: int, unseen: list[Problem], tokenizer
) -> dict[str, dict]:
    """What each update did, right away: step t's problems and the unseen ones under version t and
    t + 1 (``versions``/v<t>, version 0 = ``before``), the changes pooled over the steps."""
    policy = [before] + [f"{versions}/v{t}" for t in range(1, steps + 1)]
    unseen_demos = [render(tokenizer, demonstration(p), TOOLS) for p in unseen]
    unseen_scores = [score(path, unseen_demos) for path in policy]
    own, other = [], []
    for t in range(steps):
        demos = [
            render(tokenizer, demonstration(Problem.from_json(p)), TOOLS)
            for p in step_problems(config.problems, t)
        ]
        own.append(score(policy[t + 1], demos)[:, 0] - score(policy[t], demos)[:, 0])
        other.append(unseen_scores[t + 1][:, 0] - unseen_scores[t][:, 0])
        print(f"update {t:3d}: its own problems {own[-1].mean():+.4f}   unseen {other[-1].mean():+.4f}")
    figures = {}
    for name, deltas in (("own_problems", own), ("unseen", other)):
        pooled = np.concatenate(deltas)
        figures[name] = {"by_update": [float(d.mean()) for d in deltas], "loglik_change": paired(pooled)}
        change = figures[name]["loglik_change"]
        print(
            f"one update, {name.replace('_', ' ')}: log-likelihood of the reference {change['mean']:+.4f}"
            f" (95% CI [{change['ci95_low']:+.4f}, {change['ci95_high']:+.4f}] over {len(pooled)} problem-updates)"
        )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", required=True, help="the campaign's TOML (its [problems] are the seen set)"
    )
    parser.add_argument("--before", required=True, help="policy folder before the campaign")
    parser.add_argument("--after", default=None, help="policy folder after it (else only --versions)")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps the campaign ran (default: its config)"
    )
    parser.add_argument("--problems", type=int, default=32, help="unseen validation problems per suite")
    parser.add_argument(
        "--versions",
        default=None,
        help="a folder of the campaign's versions (v1, v2, ...: its policy/ folder): also each update's "
        "own effect, on its step's problems and on --unseen-per-update unseen ones",
    )
    parser.add_argument(
        "--unseen-per-update", type=int, default=8, help="unseen problems per suite, with --versions"
    )
    parser.add_argument("--out", default=None, help="JSON file for the figures")
    args = parser.parse_args(argv)

    config = CampaignConfig.from_toml(args.config)
    tokenizer = load_tokenizer(args.before)
    figures: dict[str, dict] = {}
    if args.versions:
        unseen = problem_sets(config, args.unseen_per_update, 0)["unseen"]
        steps = config.steps if args.steps is None else args.steps
        figures["per_update"] = per_update(config, args.before, args.versions, steps, unseen, tokenizer)
    for name, problems in problem_sets(config, args.problems, args.steps).items() if args.after else ():
        demos = [render(tokenizer, demonstration(p), TOOLS) for p in problems]
        before, after = score(args.before, demos), score(args.after, demos)
        loglik = paired(after[:, 0] - before[:, 0])
        wrong = paired(after[:, 2] - before[:, 2])
        figures[name] = {
            "problems": len(problems),
            "target_tokens_mean": float(before[:, 1].mean()),
            "loglik_before_mean": float(before[:, 0].mean()),
            "loglik_change": loglik,
            "tokens_not_greedy_before_mean": float(before[:, 2].mean()),
            "tokens_not_greedy_change": wrong,
            "problems_loglik_up": int((after[:, 0] > before[:, 0]).sum()),
        }
        print(
            f"{name:7s} {len(problems):4d} problems  log-likelihood of the reference {before[:, 0].mean():8.3f}"
            f" -> {after[:, 0].mean():8.3f} (change {loglik['mean']:+.3f}, 95% CI [{loglik['ci95_low']:+.3f},"
            f" {loglik['ci95_high']:+.3f}]; up on {figures[name]['problems_loglik_up']})"
            f"  tokens not greedy {before[:, 2].mean():.2f} -> {after[:, 2].mean():.2f}"
        )
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(
                {"config": args.config, "before": args.before, "after": args.after, **figures},
                handle,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
