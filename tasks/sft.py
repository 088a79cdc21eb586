"""The supervised warm start (`gyre model sft`): demonstrations from the problem generators' reference
solutions, next-token training on them (engines.train.sft), and a held-out evaluation before and
after through the real stack (engine + gateway + harness + graders).

Training problems and held-out problems come from disjoint generator seeds.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

from prefect import task

from environments.demos import demonstrations, gives_up
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.harness import HarnessConfig
from stack.stack import local_stack
from tasks.rollout import choose_problems, run_rollout, summarize_outcomes
from trajectory_store.storage import StoreConfig

TRAIN_SEED_BASE = 1000  # held-out problems use seeds below this


def evaluate_policy(
    model_dir: str,
    suites: list[str],
    n_per_suite: int,
    *,
    seed: int = 0,
    difficulty: int = 1,
    timeout_s: float = 120.0,
    max_turns: int = 6,
    data_root: str | None = None,
    campaign: str = "eval",
    concurrency: int = 4,
) -> dict[str, Any]:
    """Pass rate (reward 1) and mean reward on held-out problems, per suite and overall."""
    problems = [
        p for suite in suites for p in choose_problems(suite, n_per_suite, seed=seed, difficulty=difficulty)
    ]
    config = DispatchConfig(
        concurrency=concurrency,
        timeout_s=timeout_s,
        durations=DurationProfile(short_turns=max_turns, long_fraction=0.0),
        harness=HarnessConfig(temperature=0.0, max_retries=1, max_subagents=0),
    )
    with tempfile.TemporaryDirectory(prefix="gyre-eval-") as tmp:
        store = StoreConfig(data_root=data_root or f"{tmp}/store", campaign=campaign)
        with local_stack(model_dir, store, max_batch_size=8) as stack:
            outcomes = run_rollout(problems, stack.gateway_url, stack.admin_token, store, config)
    result = {"overall": summarize_outcomes(outcomes)}
    for suite in suites:
        mine = [o for o, p in zip(outcomes, problems, strict=True) if p.suite == suite]
        result[suite] = summarize_outcomes(mine)
    return result


@task(name="sft-model", task_run_name="warm-start {model_dir} -> {out}")
def sft_model(
    model_dir: str,
    out: str,
    *,
    suites: list[str],
    train_problems: int = 200,
    eval_problems: int = 10,
    steps: int = 300,
    batch_size: int = 8,
    lr: float = 2e-3,
    copy_steps: int = 1000,
    difficulty: int = 1,
    evaluate: bool = True,
    seed: int = 0,
    eval_seed: int = 0,
    recovery_share: float = 0.0,
    give_up_share: float = 0.0,
    log=print,
) -> dict[str, Any]:
    from engines.train.sft import SFTConfig, train_sft  # torch: only when asked for

    started = time.perf_counter()
    problems = [
        p
        for index, suite in enumerate(suites)
        for p in choose_problems(
            suite,
            train_problems // len(suites),
            seed=TRAIN_SEED_BASE + seed * 10 + index,
            difficulty=difficulty,
        )
    ]
    demos = demonstrations(problems, recovery_share=recovery_share, seed=seed, give_up_share=give_up_share)
    recoveries = sum(any(m.get("train") is False for m in messages) for messages, _ in demos)
    give_ups = sum(gives_up(messages) for messages, _ in demos)
    log(
        f"{len(demos)} demonstrations from {', '.join(suites)} (difficulty {difficulty}), "
        f"{recoveries} with a failed first attempt, {give_ups} giving up at once"
    )
    report: dict[str, Any] = {
        "model": model_dir,
        "out": out,
        "suites": suites,
        "recoveries": recoveries,
        "give_ups": give_ups,
    }
    if evaluate:
        report["before"] = evaluate_policy(
            model_dir, suites, eval_problems, seed=eval_seed, difficulty=difficulty
        )
        log(f"before SFT: {_line(report['before']['overall'])}")
    config = SFTConfig(steps=steps, batch_size=batch_size, lr=lr, seed=seed, copy_steps=copy_steps)
    instructions = [p.instruction for p in problems]
    report["training"] = train_sft(model_dir, demos, out, config, log=log, copy_texts=instructions)
    if evaluate:
        report["after"] = evaluate_policy(out, suites, eval_problems, seed=eval_seed, difficulty=difficulty)
        log(f"after SFT:  {_line(report['after']['overall'])}")
    report["total_s"] = time.perf_counter() - started
    return report


def _line(summary: dict[str, Any]) -> str:
    return (
        f"pass rate {summary['pass_rate']:.2f}, mean reward {summary['mean_reward']:.3f} "
        f"over {summary['executions']} held-out executions"
    )
