"""The one step recipe: the pieces of an RL step that both schedules call.

    recipe = StepsConfig(policy=..., store=..., problems=..., ...)   # the campaign's sections a step needs
    serve_policy(services, engines, version, recipe.policy)         # wake or swap, prune, re-add the dead
    chunk = pack(recipe, step)                                      # the whole step (the step flow)
    chunk = pack(recipe, step, group)                               # one group (the scheduler)
    steps = CampaignSteps(recipe, services)                         # the scheduler's Campaign

The step flow (flows/campaign.py ``rl_step``: each piece a Prefect task of tasks/campaign.py) and the
scheduler (scheduler/service.py's loop, in the process tasks/schedule.py supervises) serve, roll out,
pack, train and commit through these, so a step records the same figures and honours the same
campaign keys on both: ``problems.zero_signal`` (skip or keep; ``top_up`` is refused with the
scheduler), ``max_policy_lag``, ``keep_checkpoints`` (after every commit) and ``evaluation.every``
(tasks/problems.py ``EvaluationConfig.due``). What differs is the schedule: the step flow rolls out,
then packs the step and trains it as one batch; the scheduler packs each group as it finishes and
streams it into the core's step (tasks/train.py ``CoreService``).

``CampaignSteps`` is scheduler.service.Campaign on real services: one execution through the
dispatcher, one group packed as a chunk, the core's streaming step, engine weights, a step's work,
and the commit of a step through tasks/commit.py ``commit_step``, then its checkpoints pruned.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import replace
from typing import Any

import pyarrow.parquet as pq
from pydantic import BaseModel, Field

from engines.devices import CellDevices
from engines.quantiles import quantile
from engines.train.config import TrainerConfig
from engines.train.run import TrainStepReport, TrainStepRequest
from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig
from environments.ledger import StepLedger, group_id_for, step_ledger
from environments.problems import Problem
from environments.runner import builtin_harness_env
from environments.zygote import Zygote
from scheduler.cells import Switch
from scheduler.controller import Chunk, StepWork
from scheduler.report import Outcome, StepDone
from stack.campaign import (
    Services,
    policy_path,
    prune_fast_dir,
    readd_dead_engines,
    serve_version,
)
from stack.serving import ServingConfig
from tasks.commit import StepTimes, commit_step, prune_checkpoints, write_metric_rows
from tasks.problems import ProblemsConfig, step_problems
from tasks.train import CoreService, CoreStep, step_request
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.parts import naming_bad_parts
from trajectory_store.processor import batch_to_table
from trajectory_store.step import step_batch, step_figures
from trajectory_store.storage import Store, StoreConfig


class StepsConfig(BaseModel):
    """The sections of a campaign config a step reads, on either schedule (named as in the config)."""

    policy: str  # the starting policy (version 0)
    seed: int = 0
    max_policy_lag: int = 0
    keep_checkpoints: int = Field(2, ge=1)
    store: StoreConfig  # the campaign's (its folder is the campaign's name)
    problems: ProblemsConfig = Field(default_factory=ProblemsConfig)
    dispatch: DispatchConfig = Field(default_factory=DispatchConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    packing: PackingConfig = Field(default_factory=PackingConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)  # each cell's devices

    @property
    def skip_zero_signal(self) -> bool:
        """problems.zero_signal: "keep" packs a zero-signal group (advantage 0); the others leave it out."""
        return self.problems.zero_signal != "keep"


def serve_policy(services: Services, engines: list[str], version: int, init_model: str) -> dict[str, str]:
    """The given engines wake (or hot-swap) to ``version`` (a no-op for one already serving it), older
    in-host weight files go, and an engine that died and was started again is added back to the
    gateway ("added back"). Engine URL -> what was done."""
    done = serve_version(services, engines, version, policy_path(services, version, init_model))
    prune_fast_dir(services, version)
    for engine_id in readd_dead_engines(services, engines):
        done[engine_id] = "added back"
    return done


def pack(recipe: StepsConfig, step: int, group: str | None = None) -> Chunk:
    """Trees, selection, group-relative advantages and packing of the step's executions (with
    ``group``: that group's), in DuckDB, written as one Parquet object under ``batches/step=<n>/``;
    the chunk's figures are what was packed, trained and left out (by reason). A chunk with nothing
    to train has no ``uri``."""
    target = Store(recipe.store)
    with naming_bad_parts(target):
        con = connect(target, recipe.selection, steps=[step])
        try:
            batch, counts = step_batch(
                con,
                recipe.packing,
                step,
                trained_version=step,
                max_policy_lag=recipe.max_policy_lag,
                skip_zero_signal=recipe.skip_zero_signal,
                group=group,
            )
        finally:
            con.close()
    if not batch.sequences:
        return Chunk(None, 0, 0, counts)
    buffer = io.BytesIO()
    pq.write_table(batch_to_table(batch, step), buffer, compression=recipe.store.compression)
    path = target.path(f"batches/step={step}/{group or 'packed'}.parquet")
    target.write_bytes(path, buffer.getvalue())
    return Chunk(target.url(path), len(batch.sequences), len(batch.advantages), counts)


def executions_figures(recipe: StepsConfig, step: int) -> dict[str, float]:
    """The step's executions by status, reward, pass rate, groups and tokens (trajectory_store/step.py)."""
    target = Store(recipe.store)
    with naming_bad_parts(target):
        con = connect(target, recipe.selection, steps=[step])
        try:
            return step_figures(con, step)
        finally:
            con.close()


class CampaignSteps:
    """A campaign's pieces on its services (scheduler.service.Campaign): executions through the
    dispatcher, groups packed from the store, the core as one process for every step, engine
    weights, each step's problems, and its commit."""

    def __init__(
        self,
        recipe: StepsConfig,
        services: Services,
        *,
        trainer_threads: int = 1,
        trainer_cell: CellDevices | None = None,
    ):
        self.recipe, self.services = recipe, services
        self.trainer_threads = trainer_threads
        self.trainer_cell = trainer_cell  # the core's GPUs and cores (ServingConfig.trainer_cell)
        self.core: CoreService | None = None
        self.ledgers: dict[int, StepLedger] = {}
        self.zygote: Zygote | None = None  # one warm harness launcher for every execution it dispatches

    async def execute(self, step: int, problem: dict[str, Any], member: int) -> Outcome:
        chosen = Problem.from_json(problem)
        config = replace(self.recipe.dispatch, step=step, campaign=self.recipe.store.campaign)
        if step not in self.ledgers:  # read once a step: this process dispatches each member once
            self.ledgers[step] = step_ledger(self.recipe.store, step)
        if self.zygote is None:
            self.zygote = Zygote(builtin_harness_env())
        outcomes = await dispatch(
            [chosen],
            self.services.gateway_url,
            self.services.admin_token.get_secret_value(),
            self.recipe.store,
            config,
            {chosen.problem_id: [member]},
            ledger=self.ledgers[step],
            zygote=self.zygote,
        )
        o = outcomes[0]
        return Outcome(o.execution_id, o.group_id, o.status, float(o.reward or 0.0))

    def pack_group(self, step: int, problem: dict[str, Any]) -> Chunk:
        """The group's executions packed as one chunk (no uri: nothing in it is trained)."""
        return pack(
            self.recipe, step, group_id_for(step, Problem.from_json(problem), self.recipe.dispatch.run_id)
        )

    def prepare(self, step: int) -> float:
        """The core process started and restored at ``step`` before the controller's clock: the
        seconds it took (a start-up on the core cell's share, paid once a campaign)."""
        started = time.perf_counter()
        self._core().prepare(self._request(step))
        return time.perf_counter() - started

    def start_training(self, step: int) -> CoreStep:
        return self._core().step(self._request(step))  # no batch: the step streams

    def _core(self) -> CoreService:
        if self.core is None:
            self.core = CoreService(self.trainer_threads, self.trainer_cell)
        return self.core

    def _request(self, step: int) -> TrainStepRequest:
        """The streaming step; with cells on hosts it listens on the address the hosts reach, and its
        weights and hand-offs go to the campaign's storage for the replicas there."""
        recipe, services = self.recipe, self.services
        request = step_request(
            step, services, recipe.policy, recipe.trainer, threads=self.trainer_threads, seed=recipe.seed
        )
        if services.core_address is None:
            return request
        share = f"{services.policy_root.rstrip('/')}/streams"
        return request.model_copy(update={"address": services.core_address, "share_url": share})

    async def aclose(self) -> None:
        """Ends what lives in the event loop (the harness zygote); call before the loop ends."""
        if self.zygote is not None:
            await self.zygote.close()
            self.zygote = None

    def close(self) -> None:
        if self.core is not None:
            self.core.close()

    def weights_path(self, version: int) -> str:
        return policy_path(self.services, version, self.recipe.policy)

    def serve(self, engine_urls: list[str], version: int) -> None:
        serve_policy(self.services, engine_urls, version, self.recipe.policy)

    def step_work(self, step: int) -> StepWork:
        """The step's problems, ``group_size`` members each; the members the store holds as ended (any
        attempt but an abandoned one) are finished, never dispatched again."""
        problems = step_problems(self.recipe.problems, step)
        ledger = step_ledger(self.recipe.store, step)
        group_size = self.recipe.dispatch.group_size
        finished = {}
        for p in problems:
            for m in range(group_size):
                if (row := ledger.outcome(Problem.from_json(p), m)) is not None:
                    reward = float(row.reward or 0.0)
                    finished[(p["problem_id"], m)] = Outcome(
                        row.execution_id, row.group_id or "", row.status, reward
                    )
        return StepWork(step, problems, group_size, finished)

    def commit(self, done: StepDone, report: TrainStepReport, switches: list[Switch]) -> int:
        """The step through the campaign's one commit recipe (tasks/commit.py commit_step), then its
        old checkpoints pruned (``keep_checkpoints``), as the step flow does: its executions' figures
        and its groups' packing counts as a step flow's, the groups trained and skipped, and its
        switches (counted, p50 per direction, a metrics row per switch and phase). Returns the version."""
        store = self.recipe.store
        figures = executions_figures(self.recipe, done.step) | done.figures | switch_figures(switches)
        figures |= {
            "groups_trained": float(done.groups_trained),
            "groups_skipped": float(done.groups_skipped),
        }
        times = StepTimes(started=done.started_at, rolled_out=done.rolled_out_at, ended=done.ended_at)
        record = commit_step.fn(store, report, figures, times)
        write_switch_metrics(store, done.step, switches)
        prune_checkpoints.fn(store, done.step, self.recipe.keep_checkpoints)
        return record.version


def write_switch_metrics(store: StoreConfig, step: int, switches: list[Switch]) -> None:
    """Every switch of a step as metrics rows: its total and each phase, with its cell and what it
    moved (detail: JSON), so `gyre sql` answers "how long did drains take, per cell"."""
    rows: list[tuple[str, float, str | None, str, float]] = []
    for switch in switches:
        detail = json.dumps(switch.detail, sort_keys=True, default=str)
        rows.append((f"switch_to_{switch.to}_s", switch.seconds, switch.cell_id, detail, switch.started))
        for phase, seconds in switch.phases.items():
            rows.append((f"switch_to_{switch.to}_{phase}_s", seconds, switch.cell_id, detail, switch.started))
    write_metric_rows(store, step, rows, f"switches-{step}")


def switch_figures(switches: list[Switch]) -> dict[str, float]:
    """A step's switches: how many, and the p50 seconds of each direction that happened."""
    figures = {"switches": float(len(switches))}
    for role in ("train", "rollout"):
        p50 = quantile([s.seconds for s in switches if s.to == role], 0.5)
        if p50 is not None:
            figures[f"switch_to_{role}_p50_s"] = p50
    return figures
