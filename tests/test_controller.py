"""The controller on real processes: a two-step campaign of the shipped policy under the elastic
policy with one step in flight and the core lent to rollout (so the core rolls out each step's bulk,
each step's tail frees cells for its training and the next step calls them back), on three cells
(engines behind the gateway, replica processes, the core as a --serve process). Built from the
product's own pieces only: the local stack, the cell pool, the campaign's runtime (tasks/steps.py
CampaignSteps, its steps' work included) and the controller.

Every execution finishes and is recorded, both steps publish a version, cells move to training and
back while executions run (no switch fails), the core rolls out, trains step 0's tail and is lent
again for step 1, and no call trained in step s was sampled by a policy older than s (the staleness
bound). (The core that always trains runs in tests/test_scheduler_service.py's campaign.)"""

from __future__ import annotations

import dataclasses
import os

import pytest

from engines.admin import AdminClient
from engines.train.config import TrainerConfig
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.harness import HarnessConfig
from scheduler.cells import Cell, CellPool, CellSpec, Listed
from scheduler.controller import Controller
from scheduler.policy import make_policy
from scheduler.report import cpu_busy
from scheduler.service import cell_pool, run_controller
from stack.campaign import Services
from stack.stack import local_stack
from tasks.campaign import ProblemsConfig, problems_for, run_missing
from tasks.steps import CampaignSteps, StepsConfig
from trajectory_store.config import PackingConfig
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig

pytestmark = pytest.mark.slow

POLICY = "data/policies/tiny-sft"
SUITES = ["terminal", "repo", "swe"]


def _dispatch(group_size: int, run_id: str) -> DispatchConfig:
    return DispatchConfig(
        group_size=group_size,
        run_id=run_id,
        concurrency=1,  # the controller starts each execution itself
        timeout_s=120,
        durations=DurationProfile(short_turns=3, long_fraction=0.25, long_factor=(3.0, 6.0)),
        harness=HarnessConfig(max_tokens=96, max_retries=1, max_subagents=0, temperature=1.0),
    )


def test_elastic_runs_two_steps_on_real_cells(tmp_path):
    lag = 0
    params = {"depth": 1, "max_policy_lag": lag, "min_dwell_s": 1.0, "gain_factor": 0.0, "lend_core": True}
    data_root = str(tmp_path / "data")
    store = StoreConfig(data_root=data_root, campaign="elastic")
    fast_dir = str(tmp_path / "fast")
    os.makedirs(fast_dir)
    with local_stack(POLICY, StoreConfig(data_root=data_root), engines=3, dtype="float32") as stack:
        admin = AdminClient(stack.gateway_url, stack.admin_token, stack.engine_admin_token)
        pool = cell_pool(admin, stack.engine_urls, POLICY)
        target = Store(store)
        services = Services(
            gateway_url=stack.gateway_url,
            admin_token=stack.admin_token,
            engine_urls=stack.engine_urls,
            engine_admin_token=stack.engine_admin_token,
            policy_root=target.url(target.campaign_dir),
            fast_dir=fast_dir,
        )
        recipe = StepsConfig(
            policy=POLICY,
            max_policy_lag=lag,
            store=store,
            problems=ProblemsConfig(suites=SUITES, per_step=3, seed=7100),
            dispatch=_dispatch(2, "elastic"),
            packing=PackingConfig(token_budget=8192, advantage="grpo"),
            trainer=TrainerConfig(lr=1e-4),
        )
        runtime = CampaignSteps(recipe, services)
        try:
            controller = Controller(make_policy("elastic", **params), pool, runtime, sessions_per_cell=2)
            try:
                report = run_controller(controller, runtime, [runtime.step_work(0), runtime.step_work(1)])
            finally:
                runtime.close()
            figures = report.figures()

            # the last version, evaluated greedily on held-out problems after the makespan: the run left
            # every cell serving it (the core's cell trained last)
            held_out = StoreConfig(data_root=data_root, campaign="elastic-eval")
            base = _dispatch(1, "elastic-eval")
            greedy = dataclasses.replace(
                base,
                step=2,
                campaign=held_out.campaign,
                concurrency=6,
                harness=dataclasses.replace(base.harness, temperature=0.0),
            )
            run_missing([p.to_json() for p in problems_for(SUITES, 3, 0, 1, 1)], services, held_out, greedy)
        finally:
            pool.close()

    assert controller.errors == []
    assert figures["executions"] == 12
    assert 0 < report.cpu_busy <= 1  # the cells kept the cores busy some of the time, never more
    assert report.core_start_s > 0 and figures["core_start_s"] > 0  # the core started before the clock
    assert [s["version"] for s in figures["steps"]] == [1, 2]
    assert figures["switch_to_train_s"], "no cell moved to training"
    assert figures["switch_to_rollout_s"], "no cell came back to rollout"
    assert set(report.phases()) >= {"train.drain", "train.sleep", "rollout.wake", "rollout.register"}
    assert sum(report.role_share().values()) == pytest.approx(1.0, abs=0.01)

    # the core rolled out step 0's bulk, trained from its tail, was lent again for step 1's, trained last
    # and served again once the run ended
    core = [role for _, cell, role in report.timeline if cell == "cell-0"]
    assert core[0] == "rollout" and core[-2:] == ["train", "rollout"], core
    assert "rollout" in core[core.index("train") : -1], core
    assert report.timeline[-1][0] >= report.makespan_s - 1.0  # woken after the makespan, not within it

    con = connect(Store(store))
    statuses = dict(con.execute("SELECT status, count(*) FROM executions GROUP BY ALL").fetchall())
    oldest = dict(con.execute("SELECT step, min(policy_version) FROM calls GROUP BY step").fetchall())
    timed = con.execute(
        """SELECT e.execution_id, count(*), e.ended_at - e.started_at, sum(c.t_end - c.t_start)
           FROM executions e JOIN calls c USING (execution_id) GROUP BY ALL"""
    ).fetchall()
    con.close()
    assert sum(statuses.values()) == 12 and set(statuses) <= {"completed", "timeout"}
    assert all(version >= step - lag for step, version in oldest.items()), oldest
    assert len(timed) == 12 and all(calls >= 1 and wall > call_s > 0 for _, calls, wall, call_s in timed), (
        timed
    )

    con = connect(Store(held_out))
    versions = con.execute("SELECT DISTINCT policy_version FROM calls").fetchall()
    evaluated = con.execute("SELECT count(*) FROM executions WHERE step = 2").fetchone()[0]
    con.close()
    assert versions == [(2,)] and evaluated == 3


def test_cpu_busy_is_the_busy_share_of_the_cores_time():
    assert cpu_busy((100, 400), (160, 500)) == 0.6
    assert cpu_busy(None, (1, 2)) is None
    assert cpu_busy((5, 10), (5, 10)) is None  # no time passed: no figure rather than a division by zero


def test_a_pool_reused_for_another_run_keeps_how_long_each_cell_has_held_its_role():
    """A run restarts the pool's clock; a cell that switched long before has dwelled that long (before
    2026-12-06 its `since` kept the old clock's value, so on a reused pool no cell had dwelled until
    the new clock caught up: a lent core waited 46 s to train)."""
    now = [100.0]
    pool = CellPool(
        [Cell(CellSpec("cell-0", "http://e0", "e0", core=True), engine=None)], clock=lambda: now[0]
    )
    now[0] = 150.0
    pool.cells["cell-0"].since = pool.now() - 5.0  # switched at 45 s of the old clock, 5 s ago
    now[0] = 160.0
    pool.restart_clock()
    assert pool.now() == 0.0
    assert pool.states()[0].since == -15.0  # 15 s ago on the new clock


def test_a_pool_on_hosts_holds_a_cell_lost_while_the_gateway_lists_it_dead_and_follows_its_move():
    """A cell whose engine the gateway holds dead is lost (no policy moves it, no version is served
    to it) until the gateway lists it again; at another URL it has moved: it takes its new ends,
    serves (rollout), and is named once for its version to be served."""
    listed = {"e0": Listed("http://h1:1", None, 2), "e1": Listed("http://h2:1", "http://h2:2", 1)}
    ends = []

    def moved_to(cell: Cell, url: str, trainer_url: str | None) -> None:
        cell.spec = dataclasses.replace(cell.spec, engine_url=url)
        ends.append((cell.spec.cell_id, url, trainer_url))

    pool = CellPool(
        [
            Cell(CellSpec("cell-0", "http://h1:1", "e0", core=True), engine=None),
            Cell(CellSpec("cell-1", "http://h2:1", "e1"), engine=None),
        ],
        follow=lambda: dict(listed),
        moved_to=moved_to,
    )
    assert pool.follow_moves() == [] and pool.lost == set()
    pool.cells["cell-1"].role = "train"
    del listed["e1"]  # its host was cut off: the gateway holds its engine dead
    assert pool.follow_moves() == [] and pool.lost == {"cell-1"} and pool.take_moved() == []
    listed["e1"] = Listed("http://h1:7", "http://h1:8", 1)  # started again on h1
    states = pool.states()  # the sessions come with the listing that follows the moves
    assert [(s.cell_id, s.active_sessions) for s in states] == [("cell-0", 2), ("cell-1", 1)]
    assert pool.lost == set()
    assert ends == [("cell-1", "http://h1:7", "http://h1:8")] and pool.cells["cell-1"].role == "rollout"
    assert pool.take_moved() == ["cell-1"] and pool.take_moved() == [] and pool.follow_moves() == []
    assert [(cell, old, new) for _, cell, old, new in pool.moves] == [
        ("cell-1", "http://h2:1", "http://h1:7")
    ]
