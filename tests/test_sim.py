"""sim/: deterministic for a seed, never below its lower bound, elastic no slower than colocate on a
heavy tail, and `gyre bench schedule --quick` writing its JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cli.main import main as gyre
from scheduler.policy import make_policy
from sim.presets import PAPER_FLAGSHIP, PRESETS, Cluster, sample_workload
from sim.run import simulate

# The flagship's shape on 16 cells (128 devices) and 4 steps: the same tails, a second to run.
SMALL_FLAGSHIP = dataclasses.replace(
    PAPER_FLAGSHIP,
    steps=4,
    groups_per_step=16,
    cluster=Cluster(cells=16, devices_per_cell=8),
    async_splits=(2, 4),
)
SMALL_TAIL = dataclasses.replace(PRESETS["cpu-small-tail"], steps=6)
RUNS = {
    "colocate": ({}, 1),
    "async": ({"train_cells": 2}, 2),
    "elastic": ({}, 2),
    "elastic-sync": ({"depth": 1, "max_policy_lag": 0}, 1),
}


def run(preset, name: str, seed: int | None = None):
    params, depth = RUNS[name]
    policy = make_policy(
        name.removesuffix("-sync"), **{**preset.elastic, **params} if "elastic" in name else params
    )
    return simulate(preset, policy, name, depth, sample_workload(preset, seed))


def test_same_seed_same_campaign_and_another_seed_another():
    first, again = run(SMALL_FLAGSHIP, "elastic"), run(SMALL_FLAGSHIP, "elastic")
    strip = lambda r: {k: v for k, v in r.figures().items() if k != "sim_wall_s"}  # noqa: E731
    assert strip(first) == strip(again)
    assert run(SMALL_FLAGSHIP, "elastic", seed=1).makespan_s != first.makespan_s


@pytest.mark.parametrize("preset", [SMALL_FLAGSHIP, SMALL_TAIL], ids=lambda p: p.name)
@pytest.mark.parametrize("name", list(RUNS))
def test_makespan_is_never_below_the_lower_bound(preset, name):
    result = run(preset, name)
    assert result.makespan_s >= result.bound.seconds
    assert 0 <= result.idle_train <= 1 and 0 <= result.idle_rollout <= 1
    assert result.max_policy_lag == RUNS[name][1] - 1


def test_elastic_is_no_slower_than_colocate_on_a_heavy_tail():
    elastic, colocate = run(SMALL_FLAGSHIP, "elastic"), run(SMALL_FLAGSHIP, "colocate")
    assert elastic.share_over_4h > 0.4  # the heavy tail is really there
    assert elastic.makespan_s <= colocate.makespan_s
    assert elastic.switches > 0 and elastic.migrations > 0  # it moved cells with live sessions


def test_the_flagship_workload_is_shaped_like_the_paper():
    work = sample_workload(dataclasses.replace(PAPER_FLAGSHIP, steps=4))
    assert 600_000 < work.train_tokens.mean() < 800_000
    assert 0.5 < (work.batch1_s >= 4 * 3600).mean() < 0.7


def test_gyre_bench_schedule_quick_writes_its_json(tmp_path):
    out = tmp_path / "schedule.json"
    assert (
        gyre(["bench", "schedule", "--quick", "--sim-only", "--preset", "cpu-small", "--out", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    figures = report["presets"]["cpu-small"]
    assert set(figures["policies"]) == {"colocate", "async", "elastic", "elastic-sync"}
    assert figures["async_split"]["train_cells"] in PRESETS["cpu-small"].async_splits
    assert figures["elastic_over_async"] > 0 and figures["elastic_over_colocate"] > 0
    row = figures["policies"]["elastic"]
    for key in ("makespan_s", "idle_train", "idle_rollout", "switches", "lower_bound_s", "over_lower_bound"):
        assert key in row
