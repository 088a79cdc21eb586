"""Faults on real processes (bench/faults.py, the rows of `gyre bench faults`): a dispatcher and a
rollout engine SIGKILLed mid-step, a harness that floods the gateway, one that hangs, and the S3
store stopped while calls are recorded. After each, every group member of the step has exactly one
ending, every call the gateway answered is in the store once, and nothing took calls without an
ending."""

from __future__ import annotations

import pytest

from bench.faults import POLICY, kill_dispatcher, kill_engine, misbehaving, s3_stall
from tasks.rollout import choose_problems
from tasks.stack import local_stack
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
