"""Faults on real processes (bench/faults.py, the rows of `gyre bench faults`): a dispatcher and a
rollout engine SIGKILLed mid-step, a harness that floods the gateway, one that hangs, and the S3
store stopped while calls are recorded. After each, every group member of the step has exactly one
ending, every call the gateway answered is in the store once, and nothing took calls without an
ending."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.faults_processes import kill_dispatcher, kill_engine, misbehaving
from bench.faults_scale import s3_stall
from bench.faults_step import POLICY
from stack.stack import local_stack
from tasks.rollout import choose_problems
from trajectory_store.storage import StoreConfig

pytestmark = pytest.mark.slow

CLEAN = {"lost": 0, "duplicated": 0, "unended": 0}


def clean(counts: dict[str, int]) -> dict[str, int]:
    return {k: counts[k] for k in CLEAN}


def test_killed_processes_and_misbehaving_agents_lose_nothing(tmp_path):
    problems = choose_problems("mixed", 3, seed=11)
    store = StoreConfig(data_root=str(tmp_path / "store"), campaign="faults")
    with local_stack(POLICY, store, engines=2) as stack:
        counts, ok, recovery = kill_dispatcher(stack, problems, 2, 0, str(tmp_path))
        assert ok and clean(counts) == CLEAN, counts  # killed mid-step: attempts abandoned, run again
        assert counts["abandoned"] >= 1 and recovery > 0

        counts, ok, _, detail = misbehaving(stack, problems, 1, 1, str(tmp_path), "flood")
        assert ok and clean(counts) == CLEAN, (counts, detail)
        assert counts["calls"] >= 256  # the flood's calls were answered and every one recorded

        counts, ok, recovery, detail = misbehaving(stack, problems[:1], 1, 2, str(tmp_path), "hang")
        assert ok and clean(counts) == CLEAN and detail["bad_status"] == {"timeout": 1}, (counts, detail)
        assert recovery is not None and recovery >= 0

        counts, ok, recovery, statuses = kill_engine(stack, problems, 1, 3, str(tmp_path))
        assert ok and clean(counts) == CLEAN, (counts, statuses)  # rerouted: no execution failed
        assert stack.processes[stack.engine_urls[-1]].poll() is not None  # it really died


def test_an_s3_store_that_stops_loses_no_call(tmp_path):
    problems = choose_problems("mixed", 2, seed=11)
    counts, ok, recovery, statuses = s3_stall(problems, 1, str(tmp_path), stall_s=5.0)
    assert ok and clean(counts) == CLEAN and statuses == {"completed": 2}, (counts, statuses)
    assert counts["calls"] >= 2 and recovery is not None


# timing-sensitive (kills land in phases of a running campaign): never beside the vLLM engines' processes
@pytest.mark.xdist_group("vllm")
def test_a_campaign_lives_through_its_processes_killed(tmp_path):
    """`gyre run` (its own process, against `gyre up`'s services) while, in turn, its Prefect server
    dies mid-rollout, its trainer mid-train, an engine mid-rollout, the gateway mid-rollout, and
    then, while the roll-out task's retry runs what the gateway's death cut short, the campaign
    process itself: the supervisor in `gyre run` starts the server, the engine and the gateway
    again, the train task's retry trains the step once, and one more `gyre run --name` finishes the
    campaign. Every member of every step ended once, nothing was trained twice, and the faults show
    in the step metrics."""
    from bench.faults_campaign import (
        campaign_fault,
        mid_rollout,
        mid_train,
        pids_running,
        service_pid,
        stop_services,
    )
    from trajectory_store.db import connect
    from trajectory_store.storage import Store

    data = str(tmp_path / "colocate")
    engine_url = {}

    def engine(run) -> int:
        from stack.up import read_record

        engine_url["url"] = read_record(data).engine_urls[1]
        return service_pid(data, "engine-1")

    kills = [
        (mid_rollout(0), lambda run: service_pid(data, "prefect")),
        (mid_train(0), lambda run: pids_running(b"engines.train.run", under=run.pid)[0]),
        (mid_rollout(1), engine),
        # while an execution has a call left to make (two turns each): the gateway's death cuts it short
        (mid_rollout(2, calls=range(1, 2)), lambda run: service_pid(data, "gateway")),
        # the roll-out task's retry runs the members the gateway's death cut short as new attempts
        (mid_rollout(2, attempts=(1, 2)), lambda run: run.pid),
    ]
    try:
        counts, ok, _, detail = campaign_fault(
            tmp_path, "colocate", "kills", kills, POLICY, expect_reruns=1, steps=3
        )
    finally:
        stop_services(tmp_path)
    log_tail = Path(detail["log"]).read_text()[-4000:]  # what `gyre run` said, when a kill did not land
    assert ok and clean(counts) == CLEAN, (
        detail["unmet"],
        detail["exit_codes"],
        detail["kills"],
        counts,
        log_tail,
    )
    assert detail["kills"] == 5 and detail["exit_codes"][0] == -9 and detail["versions"] == [1, 2, 3]
    assert detail["trained_twice"] == 0 and counts["abandoned"] >= 2  # the gateway's and the run's
    assert detail["train_attempts"][0] == 2.0 and detail["train_attempts"][1:] == [1.0, 1.0]
    assert {"prefect", "engine-1", "gateway"} <= set(detail["revived"])
    assert detail["services_revived"][0] >= 1  # the server, during step 0
    con = connect(Store(StoreConfig(data_root=data, campaign="kills")))
    engines = {e for (e,) in con.execute("SELECT DISTINCT engine_id FROM calls WHERE step = 2").fetchall()}
    con.close()
    assert f"rollout-{engine_url['url'].rsplit(':', 1)[1]}" in engines  # the revived engine, taken back
