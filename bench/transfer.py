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
from tasks.campaign import choose_problems

VALIDATION_SEED = 20000


def problem_sets(
    config: CampaignConfig, unseen_per_suite: int, steps: int | None
) -> dict[str, list[Problem]]:
    seen = [
        Problem.from_json(p)
        for step in range(config.steps if steps is None else steps)
        for p in choose_problems.fn(config.problems, step)
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


def paired(delta: np.ndarray, seed: int = 0, resamples: int = 10000) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    means = delta[rng.integers(0, len(delta), (resamples, len(delta)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": float(delta.mean()), "ci95_low": float(low), "ci95_high": float(high)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", required=True, help="the campaign's TOML (its [problems] are the seen set)"
    )
    parser.add_argument("--before", required=True, help="policy folder before the campaign")
    parser.add_argument("--after", required=True, help="policy folder after it")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps the campaign ran (default: its config)"
    )
    parser.add_argument("--problems", type=int, default=32, help="unseen validation problems per suite")
    parser.add_argument("--out", default=None, help="JSON file for the figures")
    args = parser.parse_args(argv)

    config = CampaignConfig.from_toml(args.config)
    tokenizer = load_tokenizer(args.before)
    figures: dict[str, dict] = {}
    for name, problems in problem_sets(config, args.problems, args.steps).items():
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
