"""Agent executions against a gateway: choose problems, run them, summarize.

``run_rollout`` dispatches ``group_size`` executions of each problem (environments.dispatch) against a
running gateway and returns one outcome per execution, calling ``on_outcome`` as each one finishes;
`gyre rollout`, `gyre model sft|eval` and the rollout benchmark use it. ``rollout_executions`` wraps
it as a Prefect task (JSON in, JSON out: Prefect may run it in another process). Execution ids derive
from (step, problem, member) and DispatchConfig.run_id; the gateway refuses (409) to register an id it
has already finished, so a retry must dispatch only what did not finish (dispatch's ``members``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from prefect import task

from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.gateway_admin import GatewayAdminError
from environments.harness import HarnessConfig
from environments.problems import Problem, generate, read_folder
from environments.runner import ExecutionOutcome
from environments.suites import FiniteSuite, GeneratedSuite, SuiteSpec, open_suite
from trajectory_store.storage import StoreConfig

__all__ = [
    "DispatchConfig",
    "DurationProfile",
    "GatewayAdminError",
    "HarnessConfig",
    "choose_problems",
    "rollout_executions",
    "summarize_outcomes",
]

SUITE_NAMES = ("repo", "swe", "terminal")


def choose_problems(
    suite: str, n: int, *, seed: int = 0, difficulty: int = 1, length: int = 1, folder: str | None = None
) -> list[Problem]:
    """``n`` problems of a generated suite, or the first ``n`` of a folder of problems or a manifest
    (suite 'folder', ``folder`` the path); suite 'mixed' takes them round-robin from the three generated
    suites; any other name is an installed suite, or ``module:function`` a plugin
    (environments/suites)."""
    if suite == "folder":
        if not folder:
            raise ValueError(
                "suite 'folder' needs --problems PATH (a folder of problem folders, or a manifest)"
            )
        if Path(folder).is_dir():
            loaded = read_folder(folder)
            problems, errors = loaded.problems, loaded.errors
        else:
            opened = open_suite(SuiteSpec(name="manifest", path=folder))
            problems, errors = cast(FiniteSuite, opened).problems, cast(FiniteSuite, opened).errors
        for error in errors:
            print(f"skipped problem: {error}")
        return problems[:n]
    if suite == "mixed":
        per = [generate(name, n, seed=seed, difficulty=difficulty, length=length) for name in SUITE_NAMES]
        return [per[i % len(per)][i // len(per)] for i in range(n)]
    if suite in SUITE_NAMES:
        return generate(suite, n, seed=seed, difficulty=difficulty, length=length)
    spec = (
        SuiteSpec(name=suite.rpartition(":")[2], entry_point=suite) if ":" in suite else SuiteSpec(name=suite)
    )
    opened = open_suite(spec)
    if isinstance(opened, GeneratedSuite):
        return opened.generate(n, seed=seed, difficulty=difficulty, length=length)
    for error in opened.errors:
        print(f"skipped problem: {error}")
    return opened.problems[:n]


P = ParamSpec("P")
T = TypeVar("T")


def blocking(coroutine_function: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, T]:
    """``coroutine_function`` run to its end in an event loop of its own, for a caller with none."""

    @functools.wraps(coroutine_function)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return asyncio.run(coroutine_function(*args, **kwargs))

    return run


run_rollout = blocking(dispatch)  # environments.dispatch.dispatch, its signature and all


@task(name="rollout-executions", task_run_name="roll out {n_problems} problems at step {step}")
def rollout_executions(
    problems: list[dict[str, Any]],
    gateway_url: str | list[str],
    admin_token: str,
    store: StoreConfig,
    config: dict[str, Any],
    step: int,
    n_problems: int,
) -> list[dict[str, Any]]:
    """JSON in, JSON out (Prefect may run it in another process)."""
    dispatch_config = DispatchConfig.from_dict({**config, "step": step})
    outcomes = run_rollout(
        [Problem.from_json(p) for p in problems], gateway_url, admin_token, store, dispatch_config
    )
    return [asdict(o) for o in outcomes]


def summarize_outcomes(outcomes: list[ExecutionOutcome]) -> dict[str, Any]:
    graded = [o for o in outcomes if o.reward is not None and o.status != "eval_failed"]
    by_status: dict[str, int] = {}
    for outcome in outcomes:
        by_status[outcome.status] = by_status.get(outcome.status, 0) + 1
    return {
        "executions": len(outcomes),
        "by_status": by_status,
        "mean_reward": sum(o.reward for o in graded) / len(graded) if graded else 0.0,
        "pass_rate": sum(o.reward == 1.0 for o in graded) / len(outcomes) if outcomes else 0.0,
        "calls": sum(o.calls for o in outcomes),
        "branches": sum(o.branches for o in outcomes),
        "timeouts_graded": sum(
            o.status == "timeout" and o.reward_source == "workspace_snapshot" for o in outcomes
        ),
        "sandbox_violations_blocked": sum(o.violations for o in outcomes),
    }
