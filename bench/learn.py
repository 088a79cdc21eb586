"""`gyre bench learn [--quick]`: does the campaign teach the policy? Measured on held-out problems.

    gyre bench learn --quick     # configs/learn-quick.toml: what `make run` shows
    gyre bench learn             # configs/learn.toml: the full run
    gyre bench learn --config configs/learn-sft-quick.toml   # from the faithful warm start
    gyre bench learn --quick --engine vllm --out bench/results/learn-vllm.json   # rolled out by vLLM

Runs the campaign flow (flows/campaign.py) from the config's starting policy (the warm start shipped
under data/policies/) in a fresh data root, then reads the held-out evaluations back from the store:
the same problems (generator seed [evaluation].seed, never trained on: training problems come from
[problems].seed + step) evaluated before the first step and after the last ([evaluation]: greedily, or
sampled at a temperature with several executions a problem, whose pass rate is the share that passed).

Figures (bench/results/learn.json): minutes, steps, executions, pass_rate_before / pass_rate_after,
mean_reward_before / mean_reward_after, pass_rate_gain and its paired 95% interval over the held-out
problems (pass_rate_gain_ci95_low / _high: a bootstrap of the per-problem differences, 10,000
resamples, seeded), tokens_trained, naive_over_unique_tokens, and the curves (held-out pass rate per
evaluated version, training reward and pass rate per step), and the share of executions that gave
up at once (one model call, not passed) before and after, with its paired interval. `--validation`
evaluates on validation problems (generator seed 20000) instead, to choose a recipe without looking
at the held-out set.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from bench.signal import VALIDATION_SEED  # neither held-out (0), demonstrations (1000+) nor training (5000+)
from flows.campaign import campaign, campaign_store
from flows.config import CampaignConfig
from tasks.commit import committed_evaluations
from tasks.report import gave_up_by_step, held_out_gain

DEFAULT_OUT = "bench/results/learn.json"
CONFIGS = {True: "configs/learn-quick.toml", False: "configs/learn.toml"}


def figures_of(config: CampaignConfig, records: list[Any], minutes: float) -> dict[str, Any]:
    store, eval_store = campaign_store(config)
    gain = held_out_gain(eval_store, 0, config.steps)
    steps = [r.metrics for r in records]
    naive = sum(m.get("tokens_naive", 0.0) for m in steps)
    unique = sum(m.get("tokens_unique", 0.0) for m in steps)
    evaluations = committed_evaluations(store)
    gave_up_train = gave_up_by_step(store)
    figures = {
        "policy": config.policy,
        "suites": list(config.problems.suites),
        "minutes": round(minutes, 2),
        "steps": len(records),
        "executions": int(sum(m.get("executions", 0.0) for m in steps)),
        "held_out_problems": gain["held_out_problems"],
        "held_out_samples_per_problem": config.evaluation.samples,
        "held_out_temperature": config.evaluation.temperature,
    }
    figures |= {k: v for k, v in gain.items() if k.startswith(("pass_rate", "mean_reward", "problems_"))}
    figures |= {
        "tokens_trained": int(sum(m.get("tokens_trained", 0.0) for m in steps)),
        "naive_over_unique_tokens": round(naive / unique, 3) if unique else 0.0,
        "executions_zero_signal": int(sum(m.get("executions_zero_signal", 0.0) for m in steps)),
    }
    figures |= {k: v for k, v in gain.items() if k.startswith("gave_up")}
    return figures | {
        "curve_held_out": {
            str(v): {
                "pass_rate": round(f.get("pass_rate", 0.0), 4),
                "mean_reward": round(f.get("mean_reward", 0.0), 4),
            }
            for v, f in evaluations.items()
        },
        "curve_train": [
            {
                "step": r.step,
                "mean_reward": round(r.metrics.get("mean_reward", 0.0), 4),
                "pass_rate": round(r.metrics.get("pass_rate", 0.0), 4),
                "executions_trained": int(r.metrics.get("executions_trained", 0.0)),
                "gave_up": round(gave_up_train.get(r.step, 0.0), 4),
                "step_s": round(r.metrics.get("step_s", 0.0), 1),
                # how far the update moved: the trained tokens' entropy and the gradient's norm
                "entropy": round(r.metrics.get("entropy", 0.0), 4),
                "grad_norm": round(r.metrics.get("grad_norm", 0.0), 4),
            }
            for r in records
        ],
    }


def run(
    quick: bool,
    config_path: str | None = None,
    data_root: str | None = None,
    validation: bool = False,
    engine: str | None = None,
) -> dict[str, Any]:
    path = config_path or CONFIGS[quick]
    config = CampaignConfig.from_toml(path)
    if validation:
        config = config.merged({"evaluation": {"seed": VALIDATION_SEED}})
    if engine:
        config = config.merged({"serving": {"engine": engine}})
    with tempfile.TemporaryDirectory(prefix="gyre-learn-") as tmp:
        config.store.data_root = data_root or os.path.join(tmp, "data")
        started = time.perf_counter()
        records = campaign(config)
        figures = figures_of(config, records, (time.perf_counter() - started) / 60)
    figures["config"] = path
    figures["evaluation_seed"] = config.evaluation.seed
    figures["engine"] = config.serving.engine
    return figures


def main(
    quick: bool = False,
    out: str = DEFAULT_OUT,
    config: str | None = None,
    data_root: str | None = None,
    validation: bool = False,
    engine: str | None = None,
) -> int:
    figures = run(quick, config, data_root, validation, engine)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as handle:
        json.dump(figures, handle, indent=1)
    print(
        f"config                    {figures['config']} (policy {figures['policy']}, suites {figures['suites']})"
    )
    print(
        f"minutes / steps / executions  {figures['minutes']} / {figures['steps']} / {figures['executions']}"
    )
    print(
        f"held-out pass rate        {figures['pass_rate_before']} -> {figures['pass_rate_after']} "
        f"(gain {figures['pass_rate_gain']}, 95% CI [{figures['pass_rate_gain_ci95_low']}, "
        f"{figures['pass_rate_gain_ci95_high']}] over {figures['held_out_problems']} problems; "
        f"{figures['problems_gained']} gained, {figures['problems_lost']} lost)"
    )
    print(f"held-out mean reward      {figures['mean_reward_before']} -> {figures['mean_reward_after']}")
    temperature, samples = figures["held_out_temperature"], figures["held_out_samples_per_problem"]
    print(
        "held-out evaluation       "
        + ("greedy" if temperature == 0 else f"sampled at temperature {temperature}")
        + f", {samples} execution{'s' if samples > 1 else ''} per problem (a problem's pass rate: the share that passed)"
    )
    print(
        f"tokens trained            {figures['tokens_trained']} (sent / unique {figures['naive_over_unique_tokens']}x)"
    )
    if validation:
        print(f'  ("held-out" here: validation problems, generator seed {figures["evaluation_seed"]})')
    for version, point in figures["curve_held_out"].items():
        print(
            f"  version {version:>3}: held-out pass rate {point['pass_rate']}, reward {point['mean_reward']}"
        )
    print(
        "training reward by step  "
        + " ".join(f"{point['mean_reward']:.2f}" for point in figures["curve_train"])
    )
    print(
        f"gave up at once           held-out {figures['gave_up_before']:.1%} -> {figures['gave_up_after']:.1%} "
        f"(95% CI of the change [{figures['gave_up_change_ci95'][0]:+.1%}, {figures['gave_up_change_ci95'][1]:+.1%}]); "
        "by training step " + " ".join(f"{point['gave_up']:.2f}" for point in figures["curve_train"])
    )
    print(f"wrote {out}")
    return 0
