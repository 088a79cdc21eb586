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
import dataclasses
import io
import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

import pyarrow.parquet as pq
from prefect import get_run_logger, task
from prefect.artifacts import update_progress_artifact
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, field_validator, model_validator

from environments.dispatch import dispatch_missing
from environments.dispatch_config import DispatchConfig
from environments.harness import HarnessConfig
from environments.problems import Problem, generate
from environments.runner import ExecutionOutcome
from environments.suites import BUILTIN, SuiteMix, SuiteSpec, record_changes
from tasks.services.campaign import (
    Services,
    policy_path,
    prune_fast_dir,
    readd_dead_engines,
    serve_version,
    sleep_engines,
)
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.parts import naming_bad_parts
from trajectory_store.processor import batch_to_table
from trajectory_store.step import step_batch, step_figures
from trajectory_store.storage import Store, StoreConfig

logger = logging.getLogger(__name__)

__all__ = [
    "DispatchConfig",
    "EvaluationConfig",
    "HarnessConfig",
    "ProblemsConfig",
    "SuiteSpec",
]


_SUITE_SPEC = TypeAdapter(SuiteSpec)


class ProblemsConfig(BaseModel):
    """Which problems a step trains on (groups of dispatch.group_size executions each)."""

    suites: list[str | SuiteSpec] = Field(
        default_factory=lambda: ["repo"],
        description="the problem suites: a name (a built-in generator: repo, swe, terminal, or an installed "
        "suite) or a table { name, path, entry_point, weight, harness, held_out, validation } "
        "(environments/suites/spec.py SuiteSpec); generated suites named alone are taken round-robin, any "
        "other mix is apportioned by weight",
        min_length=1,
    )
    difficulty: int = Field(
        1,
        ge=1,
        description="how many required items a problem has (files to change, functions to write, bugs to "
        "fix) and how many distracting files",
    )
    length: int = Field(
        1, ge=1, description="how much text each item carries (lines, expression size, module size)"
    )
    per_step: int = Field(4, ge=1, description="problems (groups) per step")
    seed: int = Field(
        5000,
        description="step n draws its problems from generator seed seed + n; keep it away from the "
        "held-out evaluation's seed and from the warm start's (0-999 held out, 1000+ trained)",
    )
    zero_signal: Literal["skip", "top_up", "keep"] = Field(
        "skip",
        description="groups whose rewards are all equal carry no signal: skip them; top the step up with "
        "more problems while some group has none (at most top_up_rounds rounds of per_step problems), "
        "then skip those left; or keep them (advantage 0, they count in the loss's average)",
    )
    top_up_rounds: int = Field(
        1, ge=0, description='rounds of per_step more problems at most, with zero_signal = "top_up"'
    )
    pool: int = Field(
        0,
        ge=0,
        description="0: every step draws fresh problems (generator seed seed + n); N > 0: a fixed pool of "
        "N problems from generator seed seed, which the steps go through in turn, per_step at a time (epochs "
        "over a dataset; with pool = per_step, every step trains on the same problems)",
    )

    @field_validator("suites", mode="before")
    @classmethod
    def _suite_tables(cls, value: Any) -> Any:
        """A table becomes a SuiteSpec here, so an error names the suite and the key (not pydantic's
        two attempts at ``str | SuiteSpec``); a misspelt key is refused, not dropped."""
        if not isinstance(value, list):
            return value
        known = [f.name for f in dataclasses.fields(SuiteSpec)]
        specs = []
        for entry in value:
            if not isinstance(entry, dict):
                specs.append(entry)
                continue
            name = entry.get("name", "?")
            unknown = sorted(set(entry) - set(known))
            if unknown:
                raise ValueError(f"suite {name}: unknown key(s) {unknown}; a suite has {', '.join(known)}")
            try:
                specs.append(_SUITE_SPEC.validate_python(entry))
            except ValidationError as exc:
                wrong = "; ".join(
                    ".".join(map(str, e["loc"])) + ": " + e["msg"] if e["loc"] else e["msg"]
                    for e in exc.errors()
                ).replace("Value error, ", "")
                raise ValueError(wrong if wrong.startswith("suite ") else f"suite {name}: {wrong}") from None
        return specs

    @model_validator(mode="after")
    def _unique_suite_names(self) -> ProblemsConfig:
        names = self.suite_names
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"suites {doubled} appear more than once; each suite needs a name of its own")
        return self

    @property
    def suite_names(self) -> list[str]:
        return [SuiteSpec.of(s).name for s in self.suites]

    @property
    def round_robin(self) -> bool:
        """Only built-in generators, named alone: taken round-robin, as campaigns always did (a resumed
        campaign chooses the problems it chose before)."""
        return all(isinstance(s, str) and s in BUILTIN for s in self.suites)

    def relative_to(self, base: str | Path) -> ProblemsConfig:
        """A copy whose suites' relative paths are taken from ``base`` (the campaign config's folder)."""
        suites = [s.relative_to(base) if isinstance(s, SuiteSpec) else s for s in self.suites]
        return self.model_copy(update={"suites": suites})

    @model_validator(mode="after")
    def _pool_holds_a_step(self) -> ProblemsConfig:
        rounds = 1 + (self.top_up_rounds if self.zero_signal == "top_up" else 0)
        if self.pool and self.pool < self.per_step * rounds:
            raise ValueError(
                f"problems.pool = {self.pool} is smaller than one step's problems ({self.per_step} per round x "
                f"{rounds} round(s)): a step would run the same problem twice"
            )
        return self


class EvaluationConfig(BaseModel):
    """The held-out evaluation: at the start, every `every` steps and at the end."""

    every: int = Field(0, ge=0, description="evaluate every this many steps (0: at the start and the end)")
    per_suite: int = Field(8, ge=1, description="held-out problems per suite")
    seed: int = Field(0, description="generator seed of the held-out problems")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of the evaluation (0: greedy)")
    samples: int = Field(
        1,
        ge=1,
        description="executions per held-out problem (more than 1 only makes sense with temperature > 0)",
    )


# -- problems --------------------------------------------------------------------------------


def problems_for(
    suites: list[str], n: int, seed: int, difficulty: int, length: int, skip: int = 0
) -> list[Problem]:
    """``n`` problems round-robin over ``suites`` from generator ``seed``, after the first ``skip``."""
    per_suite = -(-(skip + n) // len(suites))
    pools = [generate(s, per_suite, seed=seed, difficulty=difficulty, length=length) for s in suites]
    ordered = [pools[i % len(pools)][i // len(pools)] for i in range(per_suite * len(pools))]
    return ordered[skip : skip + n]


def suite_mix(config: ProblemsConfig) -> SuiteMix:
    """The suites of ``config``, opened and split (environments/suites/mix.py)."""
    rounds = 1 + (config.top_up_rounds if config.zero_signal == "top_up" else 0)
    return SuiteMix.open(
        [SuiteSpec.of(s) for s in config.suites],
        seed=config.seed,
        per_step=config.per_step,
        rounds=rounds,
        difficulty=config.difficulty,
        length=config.length,
        pool=config.pool,
    )


@task(name="choose-problems", task_run_name="choose problems step {step} round {round}")
def choose_problems(config: ProblemsConfig, step: int, round: int = 0) -> list[dict[str, Any]]:
    if not config.round_robin:
        return [p.to_json() for p in suite_mix(config).step_problems(step, round)]
    if config.pool:
        pool = problems_for(list(config.suites), config.pool, config.seed, config.difficulty, config.length)
        start = step * config.per_step + round * config.per_step
        return [pool[(start + i) % config.pool].to_json() for i in range(config.per_step)]
    chosen = problems_for(
        list(config.suites),
        config.per_step,
        config.seed + step,
        config.difficulty,
        config.length,
        skip=round * config.per_step,
    )
    return [p.to_json() for p in chosen]


def held_out_problems(config: EvaluationConfig, problems: ProblemsConfig) -> list[dict[str, Any]]:
    """Generated suites: ``per_suite`` problems from the evaluation's seed; finite suites: their
    held_out part (at most ``per_suite``)."""
    if not problems.round_robin:
        return [p.to_json() for p in suite_mix(problems).held_out(config.per_suite, config.seed)]
    return [
        p.to_json()
        for suite in problems.suites
        for p in generate(
            suite, config.per_suite, seed=config.seed, difficulty=problems.difficulty, length=problems.length
        )
    ]


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
    con = connect(Store(store), selection)
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


class BatchSummary(BaseModel):
    uri: str | None  # None: nothing to train
    n_executions: int
    figures: dict[str, float]


@task(name="pack", task_run_name="pack step {step}", retries=2, retry_delay_seconds=1)
def pack_step(
    store: StoreConfig,
    selection: SelectionConfig,
    packing: PackingConfig,
    step: int,
    max_policy_lag: int,
    skip_zero_signal: bool,
) -> BatchSummary:
    """Trees, selection, group-relative advantages and packing of the step's executions, in DuckDB."""
    target = Store(store)
    with naming_bad_parts(target):
        con = connect(target, selection)
        figures = step_figures(con, step)
        batch, counts = step_batch(
            con,
            packing,
            step,
            trained_version=step,
            max_policy_lag=max_policy_lag,
            skip_zero_signal=skip_zero_signal,
        )
    figures.update(counts)
    if not batch.sequences:
        return BatchSummary(uri=None, n_executions=0, figures=figures)
    buffer = io.BytesIO()
    pq.write_table(batch_to_table(batch, step), buffer, compression=store.compression)
    path = target.path(f"batches/step={step}/packed.parquet")
    target.write_bytes(path, buffer.getvalue())
    return BatchSummary(uri=target.url(path), n_executions=len(batch.advantages), figures=figures)


# -- policy versions -------------------------------------------------------------------------


@task(name="serve-version", task_run_name="serve version {version}", retries=2, retry_delay_seconds=2)
def serve(services: Services, engines: list[str], version: int, init_model: str) -> dict[str, str]:
    """The given engines wake (or hot-swap) to ``version``; a no-op for an engine already serving it."""
    done = serve_version(services, engines, version, policy_path(services, version, init_model))
    prune_fast_dir(services, version)
    for engine_id in readd_dead_engines(services, engines):  # it died and was started again
        get_run_logger().warning("engine %s had died: it serves version %d again", engine_id, version)
        done[engine_id] = "added back"
    return done


@task(name="free-engines", task_run_name="free the engines for step {step}", retries=2)
def free_engines(services: Services, engines: list[str], step: int) -> None:
    sleep_engines(services, engines)
