"""The simulator calibrated from real runs on this machine, and its predictions checked against them.

A real run (bench/schedule_real.py) leaves every execution's calls in its store: how many turns it
took, the tokens each call decoded, its context, and the time between calls (tools, the harness,
grading). `measured_workload` turns those rows into the simulator's `Workload`, so the simulator
schedules exactly the executions the real run had; only the machine is modelled.

`calibrate` fits the machine on one real run (colocate, on problems of its own seed; its cells share
the cores, or each owns its share when the run was partitioned): decode
latency per token is found by bisection so that the simulated makespan equals the measured one,
the per-step update (optimizer, checkpoint, publication, engine swap) comes from the measured
steps, and the switch costs are the measured medians. The calibrated preset then predicts the
makespan of the other runs (every policy, on other problems) without seeing them.

With a second run on the same problems under a streaming policy (async), the update comes from
that run's steps (what a step costs after its last execution when training streamed beside
rollout), colocate's steps give what their switches cost until the cells are productive, and the
decode latency is fitted on the streaming run (bench/schedule_real.py does this since 2026-12-05:
one colocate run's update, 7.9 s a step, had been charged to every policy's steps, where a
streaming step spends 2-4 s).

    preset = calibrate(calibration_run, colocate, cells=4, sessions_per_cell=2)
    preset = calibrate(calibration_run, colocate, 4, 2, streaming=(async_run, async_policy, 2))
    predicted = simulate(preset_for(preset, run), make_policy("elastic", ...), "elastic", 2, run.workload)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import numpy as np

from scheduler.policy import Policy
from sim.presets import Cluster, EngineModel, Preset, Suite, TrainerModel, Workload
from sim.run import simulate

SEGMENTS = 3
SHARED_CORES = 2  # this machine's cores, shared by every cell
BATCH_COST = 0.2
"""A decode step's cost of each sequence in the batch, as a share of the step's fixed cost (sim/presets.py
`EngineModel`: ``latency_per_seq_s`` / ``latency_fixed_s``), unless measured (bench/batch_cost.py)."""


@dataclass(frozen=True)
class Execution:
    """One real execution as the store recorded it."""

    calls: int
    output_tokens: list[int]  # per call
    context_tokens: list[int]  # prompt length per call
    call_s: float  # seconds inside model calls
    wall_s: float  # started -> ended (calls, tools, harness, grading)
    trained_tokens: float  # tokens it contributed to training (0 when its group had no signal)

    @classmethod
    def recorded(
        cls, outputs: list, prompts: list, call_s: float, wall_s: float, trained_tokens: float
    ) -> Execution:
        """One execution from its store rows: its calls' output and prompt lengths in call order (a
        LEFT JOIN's None for an execution without calls dropped), seconds in calls, wall seconds."""
        outputs = [o for o in outputs if o is not None]
        return cls(
            calls=len(outputs),
            output_tokens=outputs,
            context_tokens=[p for p in prompts if p is not None],
            call_s=float(call_s),
            wall_s=float(wall_s),
            trained_tokens=float(trained_tokens),
        )


@dataclass(frozen=True)
class MeasuredRun:
    """A real run: its executions per step (in dispatch order: problem-major, then member), and what
    the run measured."""

    policy: str
    group_size: int
    executions: list[list[Execution]]  # [step][execution]
    makespan_s: float
    post_rollout_s: list[float]  # per step: the last execution's end -> the next version served
    to_train_s: float
    to_rollout_s: float
    cpu_busy: float | None = None  # share of the cores' time spent busy during the run (/proc/stat)
    partitioned: bool = False  # every cell owned its CPU share (a cgroup quota): cells do not share cores
    core_compute_s: list[float] = field(default_factory=list)
    """Per step, the seconds the core trainer spent computing micro-batches (its step's compute less
    its waits for arrivals); empty in files from before 2026-12-05."""
    sessions_per_cell: int = 2
    """Executions a rollout cell ran at once (files from before this field ran 2)."""


def core_compute_s(metrics: dict[str, float]) -> float:
    """A step's seconds of the core's own compute from its trainer metrics: the step's compute less
    its waits for arrivals (what `MeasuredRun.core_compute_s` holds per step)."""
    return max(0.0, metrics.get("compute_s", 0.0) - metrics.get("core_wait_s", 0.0))


def save_measured(runs: dict[str, list[MeasuredRun]], path: str) -> None:
    """Every run, by label (`calibration` is the one `calibrate` fits), as JSON."""
    with open(path, "w") as handle:
        json.dump({label: [dataclasses.asdict(r) for r in rs] for label, rs in runs.items()}, handle)


def load_measured(path: str) -> dict[str, list[MeasuredRun]]:
    """What `save_measured` wrote."""
    with open(path) as handle:
        raw = json.load(handle)
    runs = {}
    for label, rows in raw.items():
        runs[label] = [
            MeasuredRun(**{**r, "executions": [[Execution(**e) for e in step] for step in r["executions"]]})
            for r in rows
        ]
    return runs


def measured_workload(run: MeasuredRun) -> Workload:
    """The run's executions as the simulator's arrays (each execution's turns in SEGMENTS parts)."""
    steps, per_step = len(run.executions), len(run.executions[0])
    shape = (steps, per_step, SEGMENTS)
    decode, context, gaps = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    train = np.zeros((steps, per_step))
    for s, row in enumerate(run.executions):
        if len(row) != per_step:
            raise ValueError(f"step {s} of the {run.policy} run has {len(row)} executions, not {per_step}")
        for e, ex in enumerate(row):
            for k, part in enumerate(np.array_split(np.arange(ex.calls), SEGMENTS)):
                decode[s, e, k] = sum(ex.output_tokens[i] for i in part)
                context[s, e, k] = np.mean([ex.context_tokens[i] for i in part]) if len(part) else 0.0
            gaps[s, e, :] = max(ex.wall_s - ex.call_s, 0.0) / SEGMENTS
            train[s, e] = ex.trained_tokens
    batch1 = np.array([[ex.wall_s for ex in row] for row in run.executions])
    return Workload(decode, context, gaps, train, batch1)


def preset_for(base: Preset, run: MeasuredRun) -> Preset:
    """`base` (a calibrated machine) shaped to the run's steps and groups."""
    steps, per_step = len(run.executions), len(run.executions[0])
    return dataclasses.replace(
        base, steps=steps, groups_per_step=per_step // run.group_size, group_size=run.group_size
    )


def machine(
    cells: int,
    sessions_per_cell: int,
    latency_s: float,
    update_s: float,
    to_train_s: float,
    to_rollout_s: float,
    train_tokens_per_s: float,
    shared_cores: float | None = SHARED_CORES,
    batch_cost: float = BATCH_COST,
) -> Preset:
    """This machine's cells: one torch thread each on 2 shared cores (``shared_cores`` None: each cell
    owns its share, partitioned); a decode step of `latency_s` and `batch_cost` times that for each
    sequence in its batch, training `train_tokens_per_s` per cell."""
    return Preset(
        name="cpu-measured",
        steps=1,
        groups_per_step=1,
        group_size=1,
        suites=(Suite("measured", 1.0, 1, 0.0, 1, 0, 0.0, 0.0),),  # unused: workloads are measured
        deadline_s=10_000,
        segments=SEGMENTS,
        cluster=Cluster(cells=cells, devices_per_cell=1, shared_cores=shared_cores),
        engine=EngineModel(
            sessions_per_cell=sessions_per_cell,
            latency_fixed_s=latency_s,
            latency_per_seq_s=latency_s * batch_cost,
            latency_per_ctx_token_s=0.0,
            max_context=32768,
            kv_bytes_per_token=4096,
            migrate_bytes_per_s=1e9,
        ),
        trainer=TrainerModel(tokens_per_s=train_tokens_per_s, update_s=update_s),
        to_train_s=to_train_s,
        to_rollout_s=to_rollout_s,
        tick_s=0.25,
    )


def measured_suite(runs: list[MeasuredRun], name: str = "measured") -> Suite:
    """A suite shaped like the executions of ``runs`` (how `cpu-small` was fitted): the lognormal of
    their turns (the median and sigma of log turns), tokens decoded per turn, unique tokens added
    per turn besides the output (an execution's last context and completion over its turns, as the
    simulator counts it), the tool time per turn (wall less call seconds over the turns: the median
    and log sigma over executions, so the spread of one gap is understated), and the trained share
    of the unique tokens (groups without a signal train nothing)."""
    executions = [e for run in runs for step in run.executions for e in step if e.calls > 0]
    if not executions:
        raise ValueError("no execution with a call to fit a suite on")
    turns = np.array([e.calls for e in executions], dtype=float)
    unique = np.array([e.context_tokens[-1] + e.output_tokens[-1] for e in executions], dtype=float)
    output_per_turn = sum(sum(e.output_tokens) for e in executions) / turns.sum()
    gaps = np.array([max(e.wall_s - e.call_s, 1e-3) / e.calls for e in executions])
    return Suite(
        name,
        1.0,
        turns_median=round(float(np.exp(np.log(turns).mean())), 2),
        turns_sigma=round(float(np.log(turns).std()), 3),
        output_tokens_per_turn=round(float(output_per_turn), 1),
        context_tokens_per_turn=round(float(unique.sum() / turns.sum() - output_per_turn), 1),
        gap_median_s=round(float(np.median(gaps)), 3),
        gap_sigma=round(float(np.log(gaps).std()), 3),
        trained_share=round(float(sum(e.trained_tokens for e in executions) / unique.sum()), 4),
    )


def fit_training(tokens: list[float], seconds: list[float]) -> tuple[float, float]:
    """(update_s, seconds per trained token) from a colocate run's steps: the seconds after a step's
    last execution (less the switches) = update_s + tokens x cost, least squares. The update is mostly
    fixed (the trainer process starts, restores, checkpoints and publishes whatever it trained); a
    cost at or below 0 (the tokens' share lost in the steps' noise) leaves it all to the update."""
    x, y = np.asarray(tokens, dtype=float), np.asarray(seconds, dtype=float)
    cost = float(np.polyfit(x, y, 1)[0]) if len(set(x.tolist())) > 1 else 0.0
    if cost <= 0.0:
        return max(float(np.mean(y)), 0.1), 0.0
    update_s = float(np.mean(y) - cost * np.mean(x))
    if update_s < 0.1:  # the line runs below 0 tokens: through the origin instead
        update_s, cost = 0.1, float(np.sum(x * (y - 0.1)) / np.sum(x * x))
    return update_s, cost


def calibrate(
    run: MeasuredRun,
    policy: Policy,
    cells: int,
    sessions_per_cell: int,
    streaming: tuple[MeasuredRun, Policy, int] | None = None,
    batch_cost: float = BATCH_COST,
) -> Preset:
    """The machine fitted to one real run under `policy` (colocate: its steps show the update).
    ``batch_cost``: each decoding sequence's share of a step's fixed cost (`machine`), measured
    beforehand (bench/batch_cost.py) or the default; the bisection fits the fixed cost under it.

    The update and the training rate come from what each colocate step spends after its last
    execution ends, less the switches (`fit_training`; the simulator trains the step's tokens on
    every cell, at the shared cores' speed). The decode latency is bisected so that the simulated
    makespan of `run` equals the measured one.

    ``streaming``: a second run on the same problems, (run, its policy, its depth), under a policy
    that streams training beside rollout (async). Then:
    - the training rate is what its core measured (trained tokens over `core_compute_s`; a fit on
      three colocate steps of alike token counts is mostly their noise);
    - the update is the median time from a step's last execution to its published version, less
      one group's tokens (the last micro-batch; then the optimizer and the publication);
    - what colocate's steps spend beyond their training and that update becomes colocate's switch to
      train: the time until the switched cells are productive (pulling the weights, building the
      model), where the control plane's switch takes a few hundredths of a second;
    - the decode latency is bisected on the streaming run, whose rollout overlaps training as the
      compared streaming policies' does."""
    tokens = [sum(e.trained_tokens for e in step) for step in run.executions]
    update_s, cost = fit_training(
        tokens, [post - run.to_train_s - run.to_rollout_s for post in run.post_rollout_s]
    )
    shared = None if run.partitioned else SHARED_CORES
    share = min(1.0, (shared or cells) / cells)  # of a cell's speed, with every cell busy
    per_cell = 1e9 if cost == 0.0 else 1.0 / (cost * cells * share)
    to_train_s, fitted_run, fitted_policy, depth = run.to_train_s, run, policy, 1
    if streaming is not None:
        fitted_run, fitted_policy, depth = streaming
        streamed = sum(e.trained_tokens for step in fitted_run.executions for e in step)
        if sum(fitted_run.core_compute_s) > 0 and streamed > 0:  # measured, not fitted on a few steps
            per_cell = streamed / sum(fitted_run.core_compute_s)
        groups = len(fitted_run.executions) * len(fitted_run.executions[0]) // fitted_run.group_size
        # after a streaming step's last execution: its group's tokens, then the update
        update_s = max(0.1, float(np.median(fitted_run.post_rollout_s)) - streamed / groups / per_cell)
        surplus = [
            post - t / (per_cell * cells * share) - update_s - run.to_rollout_s
            for post, t in zip(run.post_rollout_s, tokens, strict=True)
        ]
        to_train_s = max(run.to_train_s, float(np.median(surplus)))
    work = measured_workload(fitted_run)

    def fitted(latency_s: float) -> Preset:
        return machine(
            cells,
            sessions_per_cell,
            latency_s,
            update_s,
            to_train_s,
            run.to_rollout_s,
            per_cell,
            shared,
            batch_cost,
        )

    def makespan(latency_s: float) -> float:
        base = fitted(latency_s)
        return simulate(preset_for(base, fitted_run), fitted_policy, "calibration", depth, work).makespan_s

    low, high = 1e-5, 1.0
    for _ in range(40):  # makespan grows with the latency: bisect on a log scale
        middle = float(np.sqrt(low * high))
        if makespan(middle) < fitted_run.makespan_s:
            low = middle
        else:
            high = middle
    return fitted(float(np.sqrt(low * high)))


def predict(base: Preset, run: MeasuredRun, policy: Policy, depth: int) -> float:
    """The simulated makespan of `run`'s executions under `policy` on the calibrated machine."""
    return simulate(preset_for(base, run), policy, run.policy, depth, measured_workload(run)).makespan_s


def link_pull_s(cells: int, hosts: int, weight_bytes: float, link_bytes_per_s: float) -> float:
    """Seconds until every cell has a new version when ``cells`` cells are spread evenly over ``hosts``
    hosts and each host's cells pull the weights over its one link (the busiest link's pulls)."""
    return math.ceil(cells / hosts) * weight_bytes / link_bytes_per_s


def on_hosts(
    machine: Preset, hosts: int, calibrated_hosts: int, weight_bytes: float, link_bytes_per_s: float
) -> Preset:
    """``machine``, calibrated with its cells on ``calibrated_hosts`` hosts, with them on ``hosts``:
    the same cells and cores (hosts of the same total budget), and the switch to rollout changed by
    what the busiest link's weight pulls take there instead. (Calls, answers and KV cross the links
    too, at rates far below a link's; the simulator leaves them out.)"""
    cells = machine.cluster.cells
    delta = link_pull_s(cells, hosts, weight_bytes, link_bytes_per_s) - link_pull_s(
        cells, calibrated_hosts, weight_bytes, link_bytes_per_s
    )
    return dataclasses.replace(machine, to_rollout_s=max(0.0, machine.to_rollout_s + delta))
