"""The serving stack and cell pool of bench/schedule_real.py, and one policy's campaign on them.

`RealBench` starts the stack (stack/stack.py: an engine per cell, the gateway, each cell's
CPU share as a cgroup quota where the machine allows) and the `CellPool` once; `run` resets every cell
to rollout and version 0, runs one policy's campaign with scheduler/controller.py's controller and
returns its figures, its executions as the simulator's calibration reads them (`measured`) and the
held-out pass rate of its last version (`held_out`). `cell_cpu_s` reads each cell's CPU seconds.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Literal

import numpy as np

from bench.schedule_real_work import (
    CELLS,
    HELD_OUT_PROBLEMS,
    HOST_CORES,
    POLICY,
    SESSIONS_PER_CELL,
    SUITES,
    RealWork,
    dispatch_config,
)
from engines.admin import AdminClient
from engines.devices import CellDevices
from engines.train.config import TrainerConfig
from environments.ledger import execution_id_for
from environments.problems import Problem
from scheduler.controller import Controller
from scheduler.policy import make_policy
from scheduler.service import cell_pool, run_controller
from sim.calibrate import Execution, MeasuredRun, core_compute_s
from stack.campaign import Services, policy_path, serve_version
from stack.serving import ServingConfig
from stack.stack import local_stack
from tasks.campaign import problems_for, run_missing
from tasks.steps import CampaignSteps, StepsConfig
from trajectory_store.config import PackingConfig
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig


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
        recipe = StepsConfig(
            policy=self.model,
            max_policy_lag=1,
            store=StoreConfig(data_root=self.store.data_root, campaign=campaign),
            dispatch=dispatch_config(work.group_size, label, work.temperature),
            packing=PackingConfig(token_budget=8192, advantage="grpo"),
            trainer=TrainerConfig(lr=1e-4),
        )
        runtime = CampaignSteps(recipe, services, trainer_threads=1, trainer_cell=self.core_cell())
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
            core_compute_s=[core_compute_s(s["metrics"]) for s in figures["steps"]],
        )


def cell_cpu_s(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float]:
    """CPU seconds each cell used between two readings of its cgroup (cells without a reading left out)."""
    return {
        cell: round(after[cell] - start, 2)  # type: ignore[operator]
        for cell, start in before.items()
        if start is not None and after.get(cell) is not None
    }
