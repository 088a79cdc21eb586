"""The three scheduling policies for real, on this machine's CPU: the same cells, the same work.

    python -m bench.schedule_real [--quick] [--partition none]   # also `gyre bench schedule` (`real`)

One serving stack (an engine per cell, one torch thread each, the gateway) and one `CellPool` (a
replica process per non-core cell) serve every policy in turn; each policy runs the same steps of
the same problems with the same work (heavy-tailed executions: a quarter of them run 3-6 times the
turns of the rest, the same quarter for every policy, and the same sampling seeds:
`DispatchConfig.same_work_across_runs`; before 2026-12-05 the run id keyed both, so each policy drew
its own long executions)
as its own campaign in one data root, starting from the shipped warm start, with the controller of
scheduler/controller.py deciding roles and dispatch every tick. Between policies every cell goes
back to rollout and every engine back to version 0.

The cells own their CPU share (``--partition cgroup``, the default; engines/devices/cpu_quota.py): a
cgroup per cell with a quota holds its engine, its replica and, for cell-0, the core trainer, so an
idle cell's share is lost as an idle GPU is and a cell that switches to training brings its share. The
processes of no cell (the gateway, the dispatcher, every harness and the commands it runs: what a GPU
host runs on its CPUs, beside its devices) get the host's share, HOST_CORES (1 core), and the four
cells share the other core (0.25 each): without it they took what the cells left, the machine stayed
full, and no cell's quota ever bound. Where the machine refuses cgroups
(not root, no cgroup cpu controller) one warning says so, the cells share the cores, and the figures
say ``partitioned: false``: an elastic gain cannot show then (an idle cell's CPU already goes to the
others). Each policy's CPU use per cell (seconds, and cores = seconds over the run's wall time) is
read from the cgroups.

Figures per policy: makespan (first dispatch to the last step's published version), switches and
their latency per phase, the share of cell-seconds in each role, the share of the cores' time kept
busy (`cpu_busy`: on shared cores a freed cell frees nothing, so a gain must show as cores kept
busier while the tail finishes), executions, mean rollout reward
(the reward of the executions each campaign trained on: the policies must not differ in what they
learn from, only in when), the held-out pass rate of each campaign's last version (24 problems of
generator seed 0, greedy: a speedup counts only at matching scores), and the steps' figures.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from engines.admin import AdminClient
from engines.devices import CellDevices
from engines.quantiles import quantile
from engines.train.config import TrainerConfig
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.harness import HarnessConfig
from environments.ledger import execution_id_for
from environments.problems import Problem
from scheduler.controller import Controller, StepWork
from scheduler.policy import make_policy
from scheduler.service import cell_pool, run_controller
from sim.calibrate import (
    Execution,
    MeasuredRun,
    calibrate,
    load_measured,
    measured_suite,
    predict,
    save_measured,
)
from sim.presets import Preset
from tasks.campaign import problems_for, run_missing
from tasks.schedule import CampaignRuntime
from tasks.services.campaign import Services, policy_path, serve_version
from tasks.services.serving import ServingConfig
from tasks.services.stack import local_stack
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig

POLICY = "data/policies/tiny-sft"
CELLS = 4
HELD_OUT_PROBLEMS = 24  # greedy, one execution each, generator seed 0: never trained on (7000+, 8000+)
SESSIONS_PER_CELL = 2
SUITES = ["terminal", "repo", "swe"]
DURATIONS = DurationProfile(short_turns=3, long_fraction=0.25, long_factor=(3.0, 6.0))
MAX_TOKENS = 96
# The host's share when partitioned: the gateway, the dispatcher and every harness with its commands
# (what runs on a GPU host's CPUs, beside its devices) get 1 core; the 4 cells share the other (0.25
# core each), so a cell's quota binds and a freed cell's share is lost unless it changes role.
HOST_CORES = 1.0

# The policies as compared: elastic and async keep two steps in flight (lag <= 1), colocate one.
# On CPU the training backlog is not estimated (train_backlog_s is 0), so elastic's "does the switch
# pay" test is off (gain_factor 0): it moves whenever the rollout capacity left covers the work.
# A step here trains a few seconds of a 20-30 s rollout, so elastic lends the core to rollout while a
# step rolls out its bulk (lend_core; before 2026-12-06 the core always trained, and elastic made
# async's one switch: 0.994x async).
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "colocate": ("colocate", {}),
    "async": ("async", {"train_cells": 1, "max_policy_lag": 1}),
    "elastic": (
        "elastic",
        {"depth": 2, "max_policy_lag": 1, "min_dwell_s": 2.0, "gain_factor": 0.0, "lend_core": True},
    ),
}


@dataclass(frozen=True)
class RealWork:
    steps: int
    problems_per_step: int
    group_size: int
    seed: int
    temperature: float = 1.0  # the harness's sampling temperature (held-out runs: greedy)
    sessions_per_cell: int = SESSIONS_PER_CELL  # executions a rollout cell runs at once

    def steps_work(self) -> list[StepWork]:
        return [
            StepWork(
                step,
                [p.to_json() for p in problems_for(SUITES, self.problems_per_step, self.seed + step, 1, 1)],
                self.group_size,
            )
            for step in range(self.steps)
        ]


# The workloads `--workload` chooses (compare's steps and seed are the same for each):
# default: the campaign's (groups of 2 at temperature 1.0, where about one group in eight has a signal);
# signal: more of the groups carry a signal, so a step trains 5-8x the tokens (groups of 4 at
# temperature 1.5, 6 executions a cell at once): experiments.md, 2026-12-05
WORKLOADS: dict[str, dict[str, Any]] = {
    "default": {"problems_per_step": 8, "group_size": 2},
    "signal": {"problems_per_step": 8, "group_size": 4, "temperature": 1.5, "sessions_per_cell": 6},
}


def dispatch_config(group_size: int, run_id: str, temperature: float = 1.0) -> DispatchConfig:
    return DispatchConfig(
        group_size=group_size,
        run_id=run_id,  # one gateway serves every policy: execution ids must differ between them
        same_work_across_runs=True,  # ...but not their work: the same long executions, the same seeds
        concurrency=1,  # the controller starts each execution itself
        timeout_s=120,
        durations=DURATIONS,
        harness=HarnessConfig(max_tokens=MAX_TOKENS, max_retries=1, max_subagents=0, temperature=temperature),
    )


class RealBench:
    """The stack and the pool, started once, and one policy's campaign at a time on them."""

    def __init__(
        self,
        root: str,
        model: str = POLICY,
        cells: int = CELLS,
        partition: Literal["cgroup", "none"] = "cgroup",
        host_cores: float = HOST_CORES,
    ):
        self.root, self.model, self.cells, self.partition = root, model, cells, partition
        self.host_cores = host_cores if partition == "cgroup" else 0.0
        self.store = StoreConfig(data_root=os.path.join(root, "data"))

    def __enter__(self) -> RealBench:
        started = time.perf_counter()
        self._stack = local_stack(
            self.model,
            self.store,
            engines=self.cells,
            threads=1,
            serving=ServingConfig(
                max_batch_size=8, engine_dtype="float32", partition=self.partition, host_cores=self.host_cores
            ),
        )
        stack = self._stack.__enter__()
        self.stack = stack
        try:
            admin = AdminClient(stack.gateway_url, stack.admin_token, stack.engine_admin_token)
            # each replica joins its cell's cgroup (stack.cells), the quota of which it shares with the engine
            self.pool = cell_pool(admin, stack.engine_urls, self.model, stack.cells, stack.partition)
        except BaseException as error:
            self._stack.__exit__(type(error), error, error.__traceback__)
            raise
        self.start_s = time.perf_counter() - started
        return self

    @property
    def partitioned(self) -> bool:
        """Whether every cell owns its CPU share (False: asked for 'none', or the machine refused)."""
        return self.stack.partition.partitioned

    def core_cell(self) -> CellDevices:
        """The core trainer's process: one thread, in the core cell's (cell-0's) cgroup."""
        return CellDevices(threads=1, cgroup=self.stack.cells[0].cgroup)

    def __exit__(self, *exc) -> None:
        try:
            self.pool.close()
        finally:
            self._stack.__exit__(*exc)

    def services(self, campaign: str) -> Services:
        target = Store(StoreConfig(data_root=self.store.data_root, campaign=campaign))
        fast = os.path.join(self.root, f"fast-{campaign}")
        os.makedirs(fast, exist_ok=True)
        return Services(
            gateway_url=self.stack.gateway_url,
            admin_token=self.stack.admin_token,
            engine_urls=self.stack.engine_urls,
            engine_admin_token=self.stack.engine_admin_token,
            policy_root=target.url(target.campaign_dir),
            fast_dir=fast,
        )

    def reset(self, services: Services) -> None:
        """Every cell serving version 0 (the warm start), as at the start of a campaign."""
        self.pool.all_to_rollout(0, self.model)
        serve_version(services, self.stack.engine_urls, 0, self.model)
        self.pool.switches = []

    def run(
        self,
        label: str,
        policy: str,
        params: dict[str, Any],
        work: RealWork,
        held_out: int = HELD_OUT_PROBLEMS,
    ) -> dict[str, Any]:
        """One policy's campaign on `work`; its figures, and (key `measured`) its executions as the
        simulator's calibration reads them. `cpu_busy`: the machine's CPU time spent over the time
        its cores had while the campaign ran (/proc/stat, every process: run it on a quiet machine),
        the honest idle figure when every cell shares the same cores."""
        campaign = f"schedule-{label}"
        services = self.services(campaign)
        self.reset(services)
        runtime = CampaignRuntime(
            services,
            StoreConfig(data_root=self.store.data_root, campaign=campaign),
            dispatch_config(work.group_size, label, work.temperature),
            SelectionConfig(),
            PackingConfig(token_budget=8192, advantage="grpo"),
            TrainerConfig(lr=1e-4),
            self.model,
            max_policy_lag=1,
            trainer_threads=1,
            trainer_cell=self.core_cell(),
        )
        controller = Controller(
            make_policy(policy, **params), self.pool, runtime, sessions_per_cell=work.sessions_per_cell
        )
        used_before, window_started = self.pool.cpu_usage_s(), time.perf_counter()
        host_before = self.stack.partition.host_usage_s()
        try:
            report = run_controller(controller, runtime, work.steps_work())
        finally:
            runtime.close()
        window_s = time.perf_counter() - window_started
        cpu_s = cell_cpu_s(used_before, self.pool.cpu_usage_s())
        host_after = self.stack.partition.host_usage_s()
        host_s = None if host_before is None or host_after is None else round(host_after - host_before, 2)
        figures = report.figures()
        figures.update(
            cpu_busy=report.cpu_busy,
            partitioned=self.partitioned,
            cpu_s_by_cell=cpu_s,  # {} when not partitioned
            cpu_cores_by_cell={cell: round(s / window_s, 3) for cell, s in cpu_s.items()},
            # the processes of no cell (gateway, dispatcher, harnesses and their commands) in the host's cgroup
            host_cpu_s=host_s,
            host_cpu_cores=None if host_s is None else round(host_s / window_s, 3),
            policy=label,
            params=params,
            errors=controller.errors,
            role_share=report.role_share(),
            switch_phases=report.phases(),
            timeline=[(round(t, 2), cell, role) for t, cell, role in report.timeline],
        )
        figures["measured"] = self.measured(label, campaign, work, figures)
        figures.update(self.held_out(label, services, work.steps, held_out))
        return figures

    def held_out(self, label: str, services: Services, version: int, n: int) -> dict[str, float]:
        """The campaign's last version on ``n`` held-out problems, greedy, one execution each, with
        every cell serving it (after the makespan: not timed). A policy's speed counts only at the
        score the others reach on the same work."""
        path = policy_path(services, version, self.model)
        self.pool.all_to_rollout(version, path)
        serve_version(services, self.stack.engine_urls, version, path)
        store = StoreConfig(data_root=self.store.data_root, campaign=f"schedule-{label}-eval")
        base = dispatch_config(1, f"{label}-eval")
        config = dataclasses.replace(
            base,
            step=version,
            campaign=store.campaign,
            concurrency=self.cells * SESSIONS_PER_CELL,
            harness=dataclasses.replace(base.harness, temperature=0.0),
        )
        run_missing([p.to_json() for p in problems_for(SUITES, n, 0, 1, 1)], services, store, config)
        rewards = [
            row["reward"] or 0.0
            for row in Store(store).read_table("executions").to_pylist()
            if row["status"] != "abandoned"
        ]
        if len(rewards) != n:
            raise RuntimeError(f"the {label} held-out evaluation recorded {len(rewards)} of {n} executions")
        return {
            "held_out_problems": n,
            "held_out_pass_rate": round(sum(r == 1.0 for r in rewards) / n, 4),
            "held_out_reward": round(sum(rewards) / n, 4),
        }

    def measured(self, label: str, campaign: str, work: RealWork, figures: dict[str, Any]) -> MeasuredRun:
        """The run's executions from its store (turns, tokens, call and wall time), in dispatch order."""
        con = connect(Store(StoreConfig(data_root=self.store.data_root, campaign=campaign)))
        rows = con.execute(
            """
            SELECT e.execution_id, e.group_id, e.reward, e.ended_at - e.started_at,
                   list(c.output_len ORDER BY c.call_id), list(c.prompt_len ORDER BY c.call_id),
                   coalesce(sum(c.t_end - c.t_start), 0), coalesce(sum(c.prompt_len + c.output_len - c.prefix_len), 0)
            FROM executions e LEFT JOIN calls c USING (execution_id)
            WHERE e.status <> 'abandoned'
            GROUP BY ALL
            """
        ).fetchall()
        con.close()
        by_id = {r[0]: r for r in rows}
        rewards: dict[str, set[float]] = {}
        for r in rows:
            rewards.setdefault(r[1], set()).add(round(r[2] or 0.0, 6))
        steps = []
        for step in work.steps_work():
            row = []
            for problem, member in step.members():
                # a member run again after its first attempt was abandoned ended under -a<k>
                attempts = [
                    execution_id_for(step.step, Problem.from_json(problem), member, label, attempt)
                    for attempt in range(len(rows) + 1)
                ]
                key = next((a for a in attempts if a in by_id), attempts[0])
                if key not in by_id:
                    raise RuntimeError(
                        f"the {label} run recorded no execution {key} (it holds {len(by_id)}: "
                        f"{', '.join(sorted(by_id)[:4])}, ...)"
                    )
                _, group, _, wall, outputs, prompts, call_s, unique = by_id[key]
                trained = unique if len(rewards[group]) > 1 else 0.0
                row.append(Execution.recorded(outputs, prompts, call_s, wall, trained))
            steps.append(row)
        return MeasuredRun(
            policy=label,
            group_size=work.group_size,
            sessions_per_cell=work.sessions_per_cell,
            executions=steps,
            makespan_s=figures["makespan_s"],
            post_rollout_s=[s["ended_s"] - s["rolled_out_s"] for s in figures["steps"]],
            to_train_s=float(np.median(figures["switch_to_train_s"] or [0.0])),
            to_rollout_s=float(np.median(figures["switch_to_rollout_s"] or [0.0])),
            cpu_busy=figures["cpu_busy"],
            partitioned=figures["partitioned"],
            # the core's own compute (its step's compute less its waits for arrivals): the training rate
            core_compute_s=[
                max(0.0, s["metrics"].get("compute_s", 0.0) - s["metrics"].get("core_wait_s", 0.0))
                for s in figures["steps"]
            ],
        )


def cell_cpu_s(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float]:
    """CPU seconds each cell used between two readings of its cgroup (cells without a reading left out)."""
    return {
        cell: round(after[cell] - start, 2)  # type: ignore[operator]
        for cell, start in before.items()
        if start is not None and after.get(cell) is not None
    }


CALIBRATION_SEED = 8000  # the calibration runs' problems; the compared runs use RealWork.seed
# The calibration's second run, async on the calibration problems: the update of a streaming step and
# the decode latency while training streams beside rollout (colocate's run: what its switches cost)
CALIBRATION_STREAMING = "calibration-async"


ROUNDS = 2  # every policy runs this many times, in turn (quick: once): the machine's noise, measured


def sim_check(measured: dict[str, list[MeasuredRun]]) -> tuple[Preset, dict[str, dict[str, Any]]]:
    """The simulator calibrated on the calibration runs (colocate and, where the file has it, async,
    on problems no compared run has; never elastic) predicting every run of every policy: the
    calibrated machine, and per policy the mean real and simulated makespans and the worst round's
    error (`python -m bench.schedule_real --measured FILE` does it again on saved runs; a file from
    before 2026-12-05 has only the colocate calibration run, and calibrates on it alone)."""
    policy, params = POLICIES["async"]
    streaming = (
        (measured[CALIBRATION_STREAMING][0], make_policy(policy, **params), 2)
        if CALIBRATION_STREAMING in measured
        else None
    )
    machine = calibrate(
        measured["calibration"][0],
        make_policy("colocate"),
        CELLS,
        measured["calibration"][0].sessions_per_cell,
        streaming=streaming,
    )
    sim_vs_real = {}
    for label, (policy, params) in POLICIES.items():
        spans = [run.makespan_s for run in measured[label]]
        predicted = [
            predict(machine, run, make_policy(policy, **params), 1 if label == "colocate" else 2)
            for run in measured[label]
        ]
        errors = [abs(p - r) / r for p, r in zip(predicted, spans, strict=True)]
        sim_vs_real[label] = {
            "real_s": round(float(np.mean(spans)), 2),
            "sim_s": round(float(np.mean(predicted)), 2),
            "error": round(max(errors), 4),  # the worst round
            "rounds": [
                {"real_s": r, "sim_s": round(p, 2), "error": round(e, 4)}
                for p, r, e in zip(predicted, spans, errors, strict=True)
            ],
        }
        for p, r, e in zip(predicted, spans, errors, strict=True):
            print(f"sim {label:<12} predicted {p:7.1f} s  real {r:7.1f} s  error {e:.1%}")
    return machine, sim_vs_real


# The what-if's training rates, as shares of the rate the calibration measured
WHAT_IF_RATES = (1.0, 0.8, 0.7, 0.6, 0.5, 0.25)


def what_if(
    machine: Preset, measured: dict[str, list[MeasuredRun]], tokens_per_s: list[float]
) -> list[dict[str, Any]]:
    """Where elastic would win on this machine: the calibrated simulator (`machine`) on the elastic
    runs' own executions, every execution trained in full (as if every group had a signal: its
    unique tokens, its last context plus its last completion) at ``tokens_per_s`` per train cell,
    against the best static async split (1, 2 or 3 train cells) and colocate. A prediction, not a
    measurement: the real runs train one group of eight a step (the others carry no signal), which
    the core trains beside rollout in a few seconds, so a streaming async leaves elastic nothing."""
    policy, params = POLICIES["elastic"]
    rows = []
    for rate in tokens_per_s:
        heavy = dataclasses.replace(machine, trainer=dataclasses.replace(machine.trainer, tokens_per_s=rate))
        spans: dict[str, list[float]] = {}
        for run in measured["elastic"]:
            full = dataclasses.replace(
                run,
                executions=[
                    [
                        dataclasses.replace(
                            e, trained_tokens=float(e.context_tokens[-1] + e.output_tokens[-1])
                        )
                        for e in row
                    ]
                    for row in run.executions
                ],
            )
            spans.setdefault("colocate", []).append(predict(heavy, full, make_policy("colocate"), 1))
            for split in (1, 2, 3):
                asynchronous = make_policy("async", train_cells=split, max_policy_lag=1)
                spans.setdefault(f"async-{split}", []).append(predict(heavy, full, asynchronous, 2))
            spans.setdefault("elastic", []).append(predict(heavy, full, make_policy(policy, **params), 2))
            trained = float(np.mean([sum(e.trained_tokens for e in row) for row in full.executions]))
        mean = {label: float(np.mean(values)) for label, values in spans.items()}
        best = min((label for label in mean if label.startswith("async")), key=mean.__getitem__)
        row = {
            "train_tokens_per_s": rate,
            "trained_tokens_per_step": round(trained),
            "one_cell_train_s_per_step": round(trained / rate, 1),
            "makespan_s": {label: round(value, 1) for label, value in mean.items()},
            "best_async": best,
            "speedup_vs_async": round(mean[best] / mean["elastic"], 4),
            "speedup_vs_colocate": round(mean["colocate"] / mean["elastic"], 4),
        }
        print(
            f"what-if {rate:7.1f} tokens/s a cell ({row['one_cell_train_s_per_step']:6.1f} s a step on one cell): "
            + "  ".join(f"{label} {value:6.1f}" for label, value in row["makespan_s"].items())
            + f"  elastic {row['speedup_vs_async']:.3f}x {best}, {row['speedup_vs_colocate']:.3f}x colocate"
        )
        rows.append(row)
    return rows


def compare(
    quick: bool = False,
    root: str | None = None,
    rounds: int | None = None,
    measured_out: str | None = None,
    partition: Literal["cgroup", "none"] = "cgroup",
    workload: str = "default",
) -> dict[str, Any]:
    """Every policy of POLICIES on the same work and cells, `rounds` times in turn (colocate, async,
    elastic, colocate, ...), then the simulator calibrated on a colocate and an async run of other problems
    predicting each run: the `real` section of schedule.json. A policy's makespan is the mean over
    its rounds (`makespan_rounds_s` has each); its other figures are its first round's.
    `measured_out`: also write every run's executions there (JSON, `sim.calibrate.save_measured`),
    so `python -m bench.schedule_real --measured FILE` checks the simulator against them again.
    ``partition``: 'cgroup' (each cell owns its CPU share) or 'none' (the cells share the cores)."""
    rounds = rounds or (1 if quick else ROUNDS)
    shape = {**WORKLOADS[workload], **({"problems_per_step": 6} if quick else {})}
    work = RealWork(steps=2 if quick else 3, seed=7000, **shape)
    calibration_work = dataclasses.replace(work, seed=CALIBRATION_SEED)
    own = root is None
    root = root or tempfile.mkdtemp(prefix="gyre-schedule-real-")
    runs_of: dict[str, list[dict[str, Any]]] = {}
    try:
        with RealBench(root, partition=partition) as bench:
            partitioned = bench.partitioned
            runs = [
                ("calibration", "calibration", "colocate", {}, calibration_work),
                (CALIBRATION_STREAMING, CALIBRATION_STREAMING, *POLICIES["async"], calibration_work),
            ]
            runs += [
                (label, label if r == 0 else f"{label}-r{r}", policy, params, work)
                for r in range(rounds)
                for label, (policy, params) in POLICIES.items()
            ]
            for label, run_label, policy, params, chosen in runs:
                started = time.perf_counter()
                row = bench.run(run_label, policy, params, chosen)
                runs_of.setdefault(label, []).append(row)
                busy = "-" if row["cpu_busy"] is None else f"{row['cpu_busy']:.2f}"
                cores = " ".join(f"{c:.2f}" for c in row["cpu_cores_by_cell"].values()) or "-"
                if row["host_cpu_cores"] is not None:
                    cores += f"  host {row['host_cpu_cores']:.2f}"
                print(
                    f"real {run_label:<12} makespan {row['makespan_s']:7.1f} s  switches {row['switches']:3d}  "
                    f"train share {row['role_share']['train']:.2f}  cpu busy {busy}  cell cores {cores}  "
                    f"errors {len(row['errors'])}  "
                    f"({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
            start_s = bench.start_s
        failed = {row["policy"]: row["errors"] for rows in runs_of.values() for row in rows if row["errors"]}
        if failed:  # a figure from a run whose executions or switches failed would mislead
            raise RuntimeError(f"policies with errors: {failed}")
    except BaseException:
        if own:
            print(f"the real runs failed: their stores and logs are kept in {root}", flush=True)
        raise
    if own:
        shutil.rmtree(root, ignore_errors=True)
    measured = {label: [row.pop("measured") for row in rows] for label, rows in runs_of.items()}
    if measured_out:
        save_measured(measured, measured_out)
    calibration = runs_of.pop("calibration")[0]
    calibration_streaming = runs_of.pop(CALIBRATION_STREAMING)[0]
    machine, sim_vs_real = sim_check(measured)
    rate = machine.trainer.tokens_per_s
    heavier = what_if(machine, measured, [round(rate * share, 1) for share in WHAT_IF_RATES])
    rows: dict[str, dict[str, Any]] = {}
    for label in POLICIES:
        spans = [row["makespan_s"] for row in runs_of[label]]
        rows[label] = {
            **runs_of[label][0],
            "makespan_s": round(float(np.mean(spans)), 2),
            "makespan_rounds_s": spans,
            "cpu_busy_rounds": [row["cpu_busy"] for row in runs_of[label]],
        }
        busy = [b for b in rows[label]["cpu_busy_rounds"] if b is not None]
        rows[label]["cpu_busy"] = round(float(np.mean(busy)), 3) if busy else None
    to_train = [s for runs in runs_of.values() for row in runs for s in row["switch_to_train_s"]]
    to_rollout = [s for runs in runs_of.values() for row in runs for s in row["switch_to_rollout_s"]]
    elastic = rows["elastic"]["makespan_s"]
    return {
        "work": {
            "steps": work.steps,
            "problems_per_step": work.problems_per_step,
            "group_size": work.group_size,
            "seed": work.seed,
            "calibration_seed": CALIBRATION_SEED,
            "cells": CELLS,
            "workload": workload,
            "temperature": work.temperature,
            "sessions_per_cell": work.sessions_per_cell,
            "durations": DURATIONS.__dict__,
            "max_tokens": MAX_TOKENS,
            "host_cores": HOST_CORES if partitioned else None,
            "cell_cores": round((len(os.sched_getaffinity(0)) - HOST_CORES) / CELLS, 3)
            if partitioned
            else None,
        },
        "pool_start_s": round(start_s, 1),
        "partitioned": partitioned,  # every cell in a CPU cgroup with its share as quota
        "policies": rows,
        "makespan_s": {label: row["makespan_s"] for label, row in rows.items()},
        "speedup_vs_async": round(rows["async"]["makespan_s"] / elastic, 4),
        "speedup_vs_colocate": round(rows["colocate"]["makespan_s"] / elastic, 4),
        "rounds": rounds,
        # per round, each policy's makespan over elastic's of the same round: how far noise moves it
        "speedup_vs_async_rounds": [
            round(a / e, 4)
            for a, e in zip(
                rows["async"]["makespan_rounds_s"], rows["elastic"]["makespan_rounds_s"], strict=True
            )
        ],
        "speedup_vs_colocate_rounds": [
            round(c / e, 4)
            for c, e in zip(
                rows["colocate"]["makespan_rounds_s"], rows["elastic"]["makespan_rounds_s"], strict=True
            )
        ],
        "reward_by_policy": {label: round(row["mean_reward"], 4) for label, row in rows.items()},
        # each policy's campaign's last version on the same held-out problems, per round
        "held_out_pass_rate_by_policy": {
            label: [row["held_out_pass_rate"] for row in runs_of[label]] for label in POLICIES
        },
        "cpu_busy_by_policy": {label: row["cpu_busy"] for label, row in rows.items()},
        # per policy (its first round), each cell's CPU use from its cgroup: seconds, and cores
        "cpu_s_by_policy": {label: row["cpu_s_by_cell"] for label, row in rows.items()},
        "cpu_cores_by_policy": {label: row["cpu_cores_by_cell"] for label, row in rows.items()},
        "switch_s": {
            **{
                f"to_{role}_p{q}": None if (value := quantile(seconds, q / 100)) is None else round(value, 3)
                for role, seconds in (("train", to_train), ("rollout", to_rollout))
                for q in (50, 95)
            },
            "count": len(to_train) + len(to_rollout),
        },
        "calibration": {
            "makespan_s": calibration["makespan_s"],
            "streaming_makespan_s": calibration_streaming["makespan_s"],
            "latency_s_per_token": round(machine.engine.latency_fixed_s, 5),
            "update_s": round(machine.trainer.update_s, 2),
            "train_tokens_per_s": round(machine.trainer.tokens_per_s, 1),  # per cell, cores not shared
            "to_train_s": round(machine.to_train_s, 3),
            "to_rollout_s": round(machine.to_rollout_s, 3),
        },
        "sim_vs_real": sim_vs_real,
        "sim_vs_real_error": max(v["error"] for v in sim_vs_real.values()),
        # the calibrated simulator with every execution trained, at shares of the measured rate
        "what_if_every_group_trained": heavier,
    }


def main() -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    parser.add_argument("--measured-out", default=None, help="also write every run's executions here (JSON)")
    parser.add_argument(
        "--partition",
        choices=["cgroup", "none"],
        default="cgroup",
        help="cgroup: each cell owns its CPU share (a cgroup quota; needs root); none: the cells share the cores",
    )
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="default",
        help="default: the campaign's groups of 2; signal: groups of 4 at temperature 1.5, 6 executions "
        "a cell, so that more groups carry a signal and a step trains more",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"runs of each policy (default {ROUNDS}; quick 1)"
    )
    parser.add_argument(
        "--measured", default=None, help="no runs: check the simulator against the runs saved in this file"
    )
    parser.add_argument(
        "--what-if",
        type=float,
        nargs="+",
        default=None,
        metavar="TOKENS_PER_S",
        help="with --measured: predict every policy with every execution trained, at these tokens/s a train cell",
    )
    args = parser.parse_args()
    if args.what_if and not args.measured:
        parser.error("--what-if needs --measured FILE (the runs it predicts)")
    if args.what_if:
        measured = load_measured(args.measured)
        machine, _ = sim_check(measured)
        print(json.dumps(what_if(machine, measured, args.what_if), indent=1))
        return 0
    if args.measured:
        runs = load_measured(args.measured)
        machine, checked = sim_check(runs)
        calibration = runs["calibration"] + runs.get(CALIBRATION_STREAMING, [])
        fitted = {
            "update_s": round(machine.trainer.update_s, 2),
            "train_tokens_per_s": round(machine.trainer.tokens_per_s, 1),
            "latency_s_per_token": round(machine.engine.latency_fixed_s, 5),
            "to_train_s": round(machine.to_train_s, 2),
            "to_rollout_s": round(machine.to_rollout_s, 3),
            # the calibration runs' executions as a simulator suite (how sim/presets.py's cpu-small was fitted)
            "suite": dataclasses.asdict(measured_suite(calibration, "short")),
        }
        print(json.dumps({**fitted, "sim_vs_real": checked}, indent=1))
        return 0
    figures = compare(
        args.quick,
        rounds=args.rounds,
        measured_out=args.measured_out,
        partition=args.partition,
        workload=args.workload,
    )
    print(json.dumps({k: v for k, v in figures.items() if k != "policies"}, indent=1))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(figures, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
