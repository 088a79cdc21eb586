"""The RL campaign: Prefect flows that train an agent end to end.

    from flows.campaign import campaign
    campaign(CampaignConfig.from_toml("configs/demo.toml"))

``campaign`` records the suites' split (tasks/campaign.py record_suites: written once, a changed suite
refused on resume), starts the serving stack (engines + gateway), evaluates the starting policy on held-out
problems, runs ``rl_step`` for every step not yet committed (a subflow run per step, named
``step <n>``), evaluates every ``evaluation.every`` steps and at the end, and returns the records.
Run again with the same campaign name, it resumes after the last committed step: every task is
idempotent against the store (tasks/campaign.py says how).

One step, top to bottom (each line a task): serve version n -> choose problems -> roll out (dispatch,
record, grade, snapshots for timeouts) -> [top up zero-signal groups] -> pack (trees, selection,
group-relative advantages, staleness) -> free the engines -> train (version n -> n + 1, checkpoint,
publish) -> commit (tasks/commit.py commit_step: the one recipe of a committed step, which the
scheduler's steps commit through too). The placement (which engines serve, which cells train) comes from
stack/placement.py; this issue's is Colocate.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.config import CampaignConfig
from stack.campaign import Services, campaign_services
from stack.placement import Colocate, Placement
from tasks.campaign import (
    StepProgress,
    choose_problems,
    evaluate,
    free_engines,
    held_out_problems,
    pack_step,
    record_suites,
    roll_out,
    serve,
)
from tasks.commit import (
    StepRecord,
    StepTimes,
    commit_step,
    committed_evaluations,
    committed_steps,
    last_committed,
    prune_checkpoints,
    record_evaluation,
)
from tasks.report import campaign_summary, role_timeline, start_progress, step_table, update_progress
from tasks.schedule import Message, ScheduleJob, run_scheduler
from tasks.steps import StepsConfig
from tasks.tracking import track
from tasks.train import BatchSummary, step_request, train_step
from tasks.trajectory import StoreConfig


def campaign_store(config: CampaignConfig):
    """The store of the campaign (its folder is the campaign's name) and of its held-out evaluation."""
    store = config.store.model_copy(update={"campaign": config.name})
    return store, store.model_copy(update={"campaign": f"{config.name}-eval"})


def steps_config(config: CampaignConfig) -> StepsConfig:
    """The sections of ``config`` the step recipe reads (tasks/steps.py), with the campaign's store."""
    named = {name: getattr(config, name) for name in StepsConfig.model_fields.keys() - {"store"}}
    return StepsConfig(store=campaign_store(config)[0], **named)


@flow(name="rl-step", flow_run_name="step {step}")
def rl_step(
    config: CampaignConfig, step: int, services: Services, progress: StepProgress | None = None
) -> StepRecord:
    started = time.time()
    placement: Placement = Colocate()
    store, _ = campaign_store(config)
    serve(services, placement.rollout(services, config.serving).serving, step, config.policy)
    batch = _roll_out_and_pack(config, services, store, step, progress)
    rolled = time.time()
    training = placement.training(services, config.serving)
    free_engines(services, training.sleeping, step)
    threads = training.trainer_threads
    request = step_request(
        step, services, config.policy, config.trainer, threads=threads, seed=config.seed, batch=batch
    )
    report = train_step(request, cell=training.trainer, cluster=config.cluster)
    times = StepTimes(started=started, rolled_out=rolled, ended=time.time())
    record = commit_step(store, report, batch.figures, times)
    prune_checkpoints(store, step, config.keep_checkpoints)
    return record


def _roll_out_and_pack(
    config: CampaignConfig,
    services: Services,
    store: StoreConfig,
    step: int,
    progress: StepProgress | None,
) -> BatchSummary:
    """The step's executions and its batch; with problems.zero_signal = "top_up", another round of
    problems while some group carries no signal (at most top_up_rounds)."""
    recipe = steps_config(config)
    rounds = config.problems.top_up_rounds if config.problems.zero_signal == "top_up" else 0
    for round in range(rounds + 1):
        problems = choose_problems(config.problems, step, round)
        roll_out(problems, services, store, config.dispatch, step, progress if round == 0 else None)
        batch = pack_step(recipe, step)
        if batch.figures.get("executions_zero_signal", 0) == 0:
            break
    return batch


def _evaluate(config: CampaignConfig, services: Services, version: int) -> dict[str, float]:
    """The held-out evaluation of ``version``; none (a warning) when no problem is held out."""
    store, eval_store = campaign_store(config)
    problems = held_out_problems(config.evaluation, config.problems)
    if not problems:
        get_run_logger().warning(
            "evaluation is off: no problem of any suite is held out, so version %d is not evaluated "
            "(give a suite held_out = [ids] or a fraction)",
            version,
        )
        return {}
    serve(services, Colocate().rollout(services, config.serving).serving, version, config.policy)
    figures = evaluate(
        problems,
        services,
        eval_store,
        config.dispatch,
        version,
        config.selection,
        config.evaluation,
    )
    record_evaluation(store, version, figures)
    _track(config)
    return figures


def _track(config: CampaignConfig) -> None:
    """MLflow and TensorBoard catch up with the store (tasks/tracking.py); a view, never an error."""
    track(config.tracking, campaign_store(config)[0], config.model_dump(mode="json"), config.steps)


@flow(name="campaign", flow_run_name="{config.name}", log_prints=True)
def campaign(config: CampaignConfig) -> list[StepRecord]:
    logger = get_run_logger()
    store, _ = campaign_store(config)
    last = last_committed(store)
    start = last.step + 1 if last else 0
    progress = start_progress(config.name, min(start, config.steps), config.steps)
    if start >= config.steps:
        logger.info("campaign %s: every one of its %d steps is committed", config.name, config.steps)
        _track(config)
        return []
    record_suites(config.problems, store)  # written once; on resume, refuses suites that changed
    records = []
    scheduled = config.scheduler.policy is not None
    with campaign_services(config.policy, store, config.serving, config.cluster, scheduled) as services:
        logger.info("campaign %s: steps %d to %d", config.name, start, config.steps - 1)
        _evaluate(config, services, start)
        if config.scheduler.policy is not None:
            return _scheduled(config, services, start, progress)
        for step in range(start, config.steps):
            record = rl_step(
                config, step, services, StepProgress(artifact_id=progress, total_steps=config.steps)
            )
            records.append(record)
            step_table(config.name, record)
            _track(config)
            version = step + 1
            if config.evaluation.due(version, config.steps):
                _evaluate(config, services, version)
            update_progress(progress, version, config.steps)
            campaign_summary(config.name, committed_steps(store), committed_evaluations(store))
    return records


def _scheduled(config: CampaignConfig, services: Services, start: int, progress) -> list[StepRecord]:
    """The steps under the scheduler service (tasks/schedule.py): one long-running task that keeps a
    scheduler process alive; each step it commits shows up here as it lands."""
    store, _ = campaign_store(config)
    from_config = ScheduleJob.model_fields.keys() - StepsConfig.model_fields.keys() - {"start", "services"}
    named = {name: getattr(config, name) for name in from_config}  # named as in the config
    job = ScheduleJob(**steps_config(config).model_dump(), start=start, services=services, **named)

    samples: list[dict] = []  # heartbeats where the roles changed: wall time, roles, cells switching
    commits: list[tuple[float, int]] = []

    def seen(message: Message, pid: int) -> None:
        beat = message.heartbeat
        if beat and (
            not samples or (beat.roles, beat.switching) != (samples[-1]["roles"], samples[-1]["switching"])
        ):
            samples.append(beat.model_dump())
        if message.committed is not None:
            commits.append((message.committed.wall, message.committed.step))
            update_progress(progress, message.committed.version, config.steps)
            _track(config)

    done = run_scheduler(job, config.steps - 1, on_line=seen)
    for error in done.get("errors", []):  # a switch that failed left its cell in its role: the run went on
        get_run_logger().warning("campaign %s: the scheduler reported: %s", config.name, error)
    if samples:
        samples.append({**samples[-1], "wall": time.time()})  # the last roles, held to the end
    role_timeline(config.name, samples, commits)
    records = [r for r in committed_steps(store) if r.step >= start]
    for record in records:
        step_table(config.name, record)
    # the cells roll out while the scheduler runs: its versions are evaluated once it has ended
    for version in range(start + 1, config.steps + 1):
        if config.evaluation.due(version, config.steps):
            _evaluate(config, services, version)
    campaign_summary(config.name, committed_steps(store), committed_evaluations(store))
    return records


@flow(name="scheduled-campaign", flow_run_name="{name}")
def scheduled_campaign(
    config_path: str = "configs/demo.toml", name: str = "scheduled", overrides: dict | None = None
) -> list[StepRecord]:
    """A campaign started by a deployment (deployments/prefect.yaml): the config file with ``overrides``
    (a partial config, merged section by section), named ``<name>-<the flow run id's first 8 hex>``, so
    every scheduled run is a campaign of its own and a retry of that run resumes it."""
    config = CampaignConfig.from_toml(config_path).merged(overrides or {})
    run_id = flow_run.id
    config.name = f"{name}-{run_id.split('-')[0]}" if run_id else name
    return campaign(config)
