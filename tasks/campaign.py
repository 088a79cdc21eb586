"""Prefect tasks of an RL campaign: choose problems, roll them out, evaluate, build the step's batch,
serve a policy version (committing a step and recording an evaluation: tasks/commit.py).

Every task is idempotent against the store, which is the campaign's record (not Prefect's result
storage, which a lost Prefect database or another machine would not have):

- problems derive from (the campaign's seed, the step, the top-up round): the same every time;
- execution ids derive from (step, problem, member); ``roll_out`` reads which of them the store
  already holds and dispatches only the others, so a retried task or step never runs a finished
  execution again;
- a step is committed by ``steps/step=<n>.json`` (tasks/commit.py), written after its checkpoint and
  its published policy, so a step that has one is never run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact, update_progress_artifact
from pydantic import BaseModel

from environments.dispatch import dispatch_missing
from environments.dispatch_config import DispatchConfig
from environments.harness_config import HarnessConfig
from environments.problems import Problem
from environments.runner import ExecutionOutcome
from environments.suites import SuiteSpec, record_changes
from stack.campaign import Services, sleep_engines
from tasks.problems import (
    EvaluationConfig,
    ProblemsConfig,
    held_out_problems,
    problems_for,
    step_problems,
    suite_mix,
)
from tasks.steps import StepsConfig, executions_figures, pack, serve_policy
from tasks.train import BatchSummary
from trajectory_store.config import SelectionConfig
from trajectory_store.db import connect
from trajectory_store.step import step_figures
from trajectory_store.storage import Store, StoreConfig

logger = logging.getLogger(__name__)

__all__ = [
    "DispatchConfig",
    "EvaluationConfig",
    "HarnessConfig",
    "ProblemsConfig",
    "SuiteSpec",
    "held_out_problems",
    "problems_for",
    "step_problems",
]


@task(name="choose-problems", task_run_name="choose problems step {step} round {round}")
def choose_problems(config: ProblemsConfig, step: int, round: int = 0) -> list[dict[str, Any]]:
    """The step's problems (tasks/problems.py step_problems), listed in a table artifact of this task
    run: what the UI shows under the task."""
    problems = step_problems(config, step, round)
    create_table_artifact(
        problems_table(problems),
        description=f"the {len(problems)} problems of step {step}, round {round}",
    )
    return problems


def problems_table(problems: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per problem: its id, suite, grader and the first line of its instruction."""
    rows = []
    for problem in problems:
        grader = "checks" if problem.get("checks") else "pytest" if problem.get("grader") else "command"
        lines = str(problem.get("instruction", "")).strip().splitlines()
        first = lines[0] if lines else ""
        rows.append(
            {
                "problem": problem["problem_id"],
                "suite": str(problem.get("suite", "")),
                "grader": grader,
                "instruction": first if len(first) <= 100 else first[:99] + "…",
            }
        )
    return rows


SPLIT_RECORD = "suites.json"


@task(name="record-suites", task_run_name="record the suites' split")
def record_suites(config: ProblemsConfig, store: StoreConfig) -> dict[str, Any]:
    """Writes the suites' split (which problems train, which are held out, a hash of each) into the
    campaign's folder the first time; later, refuses to go on if the suites changed since (ValueError
    naming each problem that did)."""
    if config.round_robin:
        now = {"version": 1, "suites": [{"name": n, "kind": "generated"} for n in config.suite_names]}
    else:
        now = suite_mix(config).record()
    target = Store(store)
    path = target.path(SPLIT_RECORD)
    if not target.exists(path):
        target.write_bytes(path, json.dumps(now, indent=1, sort_keys=True).encode())
        return now
    changes = record_changes(json.loads(target.read_bytes(path)), now)
    if changes:
        shown = "\n  ".join(changes[:20]) + (
            f"\n  ... and {len(changes) - 20} more" if len(changes) > 20 else ""
        )
        raise ValueError(
            f"campaign {store.campaign}: its suites changed since it started ({target.url(path)} records "
            f"them):\n  {shown}\nput the suites back, or start a campaign of another name"
        )
    return now


# -- rollouts --------------------------------------------------------------------------------


def run_missing(
    problems: list[dict[str, Any]],
    services: Services,
    store: StoreConfig,
    config: DispatchConfig,
    on_outcome: Callable[[ExecutionOutcome], None] | None = None,
) -> dict[str, Any]:
    """Dispatches the members of ``problems`` the store does not hold yet; counts both."""
    outcomes, ended = asyncio.run(
        dispatch_missing(
            [Problem.from_json(p) for p in problems],
            services.gateway_urls or services.gateway_url,
            services.admin_token.get_secret_value(),
            store,
            config,
            on_outcome,
        )
    )
    return {
        "dispatched": len(outcomes),
        "already_finished": ended,
        "by_status": {s: sum(o.status == s for o in outcomes) for s in {o.status for o in outcomes}},
    }


# a gateway that died is started again by the supervisor (tasks/up.watch) within seconds: the retries
# wait long enough for it, and each runs only the members with no ending yet
RETRY_DELAYS_S = [5, 15, 30]


@task(name="roll-out", task_run_name="roll out step {step}", retries=3, retry_delay_seconds=RETRY_DELAYS_S)
def roll_out(
    problems: list[dict[str, Any]],
    services: Services,
    store: StoreConfig,
    config: DispatchConfig,
    step: int,
    progress: StepProgress | None = None,
) -> dict[str, Any]:
    """Runs the step's executions against the gateway (graded; timeouts from their snapshots); with
    ``progress``, the campaign's progress artifact moves as each execution finishes."""
    config = replace(config, step=step, campaign=store.campaign)
    if progress is None:
        return run_missing(problems, services, store, config)
    expected = len(problems) * config.group_size
    with progress.reporter(step, expected) as report:
        return run_missing(problems, services, store, config, report)


class StepProgress(BaseModel):
    """The campaign's progress artifact, moved by each finished execution of a step."""

    artifact_id: UUID
    total_steps: int

    @contextlib.contextmanager
    def reporter(self, step: int, expected: int) -> Iterator[Callable[[ExecutionOutcome], None]]:
        """A callback for dispatch. The artifact is updated on a thread of its own (dispatch's event
        loop is running) with the caller's Prefect context (its API URL); a failed update is logged,
        never raised: progress is a view."""
        context = contextvars.copy_context()
        finished = 0
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-progress") as pool:

            def update(value: float) -> None:
                try:
                    update_progress_artifact(self.artifact_id, value)
                except Exception:
                    logger.warning("the progress artifact could not be updated", exc_info=True)

            def report(outcome: ExecutionOutcome) -> None:
                nonlocal finished
                finished += 1
                value = 100.0 * (step + min(finished, expected) / max(expected, 1)) / max(self.total_steps, 1)
                pool.submit(context.copy().run, update, value)

            yield report


@task(
    name="evaluate", task_run_name="evaluate version {version}", retries=3, retry_delay_seconds=RETRY_DELAYS_S
)
def evaluate(
    problems: list[dict[str, Any]],
    services: Services,
    store: StoreConfig,
    config: DispatchConfig,
    version: int,
    selection: SelectionConfig,
    evaluation: EvaluationConfig,
) -> dict[str, float]:
    """The held-out evaluation of policy ``version``: ``samples`` executions per problem at the
    evaluation's temperature, recorded in the evaluation campaign ``store`` at step ``version`` (never
    trained on); its figures, per suite too."""
    harness = replace(config.harness, temperature=evaluation.temperature)
    changes = {
        "step": version,
        "group_size": evaluation.samples,
        "campaign": store.campaign,
        "harness": harness,
    }
    run_missing(problems, services, store, replace(config, **changes))
    con = connect(Store(store), selection, steps=[version])
    figures = step_figures(con, version)
    by_suite = con.execute(
        """SELECT split_part(problem_id, '-', 1), avg(CASE WHEN reward = 1.0 THEN 1.0 ELSE 0.0 END), avg(reward)
           FROM executions WHERE step = ? AND status <> 'abandoned' GROUP BY ALL ORDER BY 1""",
        [version],
    ).fetchall()
    for suite, pass_rate, reward in by_suite:
        figures[f"pass_rate_{suite}"] = float(pass_rate)
        figures[f"mean_reward_{suite}"] = float(reward or 0.0)
    return figures


# -- the step's batch ------------------------------------------------------------------------


@task(name="pack", task_run_name="pack step {step}", retries=2, retry_delay_seconds=1)
def pack_step(recipe: StepsConfig, step: int) -> BatchSummary:
    """Trees, selection, group-relative advantages and packing of the step's executions, in DuckDB
    (tasks/steps.py pack: the scheduler packs each group through it too); the step's figures."""
    chunk = pack(recipe, step)
    figures = executions_figures(recipe, step) | chunk.figures
    return BatchSummary(uri=chunk.uri, n_executions=chunk.executions, figures=figures)


# -- policy versions -------------------------------------------------------------------------


@task(name="serve-version", task_run_name="serve version {version}", retries=2, retry_delay_seconds=2)
def serve(services: Services, engines: list[str], version: int, init_model: str) -> dict[str, str]:
    """The given engines wake (or hot-swap) to ``version``; a no-op for an engine already serving it."""
    done = serve_policy(services, engines, version, init_model)
    for engine_id in [e for e, what in done.items() if what == "added back"]:  # it died, was started again
        get_run_logger().warning("engine %s had died: it serves version %d again", engine_id, version)
    return done


@task(name="free-engines", task_run_name="free the engines for step {step}", retries=2)
def free_engines(services: Services, engines: list[str], step: int) -> None:
    sleep_engines(services, engines)
