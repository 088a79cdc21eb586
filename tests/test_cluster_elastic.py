"""The elastic scheduler on cells across hosts (issue 50): each cell a flow run on its host's work pool
serving an engine and, beside it, a trainer replica (scheduler/remote.py); the scheduler process in
the root namespace switches cells between rollout and training, and a cell switched to training on
another host joins the core's streaming step there and computes micro-batches. Nothing is lost,
recorded twice or trained twice (bench/cluster.py, as the colocate three-host test)."""

from __future__ import annotations

import pytest

ELASTIC = {"policy": "elastic", "params": {"depth": 1, "min_dwell_s": 1.0, "gain_factor": 0.0}}


@pytest.mark.slow
def test_the_elastic_scheduler_switches_cells_on_two_hosts_and_their_replicas_train(tmp_path):
    from bench.cluster import campaign_on_hosts

    figures = campaign_on_hosts(tmp_path, cells=[1, 2], heartbeat_misses=5, scheduler=ELASTIC)
    shown = {k: v for k, v in figures.items() if k != "measured"}
    assert figures["steps"] == 2 and figures["executions"] == 12, shown
    assert figures["executions_lost"] == 0 and figures["executions_recorded_twice"] == 0, shown
    assert figures["calls_recorded_twice"] == 0 and figures["trained_twice"] == 0, shown
    assert all(n >= 1 for n in figures["switches_by_step"]), shown  # cells moved to training and back
    # a replica on h2 joined a step and computed part of it
    assert max(figures["satellites_by_step"]) >= 1 and sum(figures["micro_batches_off_core"]) >= 1, shown
    assert {run["state"] for run in figures["cell_runs"].values()} == {"CANCELLED"}, shown
    assert figures["engines_left_listening"] == 0, shown
