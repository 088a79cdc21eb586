"""sim/: deterministic for a seed, never below its lower bound, elastic no slower than colocate on a
heavy tail, and `gyre bench schedule --quick` writing its JSON."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from cli.main import main as gyre
from scheduler.policy import make_policy
from sim.presets import PAPER_FLAGSHIP, PRESETS, Cluster, sample_workload
from sim.run import Simulation, simulate

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
    assert 0 <= result.dispatch_spread_s < result.step_span_s < result.makespan_s
    assert result.max_policy_lag == RUNS[name][1] - 1


def test_elastic_is_no_slower_than_colocate_on_the_flagship():
    elastic, colocate = run(SMALL_FLAGSHIP, "elastic"), run(SMALL_FLAGSHIP, "colocate")
    assert elastic.makespan_s <= colocate.makespan_s
    assert elastic.switches > 0 and elastic.migrations > 0  # it moved cells with live sessions


def test_the_flagship_workload_is_shaped_like_the_paper():
    work = sample_workload(dataclasses.replace(PAPER_FLAGSHIP, steps=4))
    assert 600_000 < work.train_tokens.mean() < 800_000  # ~700K tokens per rollout
    # a step of 1.5-3 hours: its longest execution at batch-1 speed runs well under the deadline
    assert work.batch1_s.max(axis=1).max() < 2.5 * 3600 < PAPER_FLAGSHIP.deadline_s
    assert work.prefill_tokens.sum() > 5 * work.decode_tokens.sum()  # tool results dominate the tokens


# the rows of every preset's comparison (bench/schedule.py), as `gyre sim` and `gyre bench schedule` write them
COMPARED_POLICIES = {
    "colocate",
    "async",
    "async-paperlike",
    "elastic",
    "elastic-core",
    "elastic-sync",
    "elastic-oracle",
}


def test_gyre_bench_schedule_quick_writes_its_json(tmp_path):
    out = tmp_path / "schedule.json"
    assert (
        gyre(["bench", "schedule", "--quick", "--sim-only", "--preset", "cpu-small", "--out", str(out)]) == 0
    )
    report = json.loads(out.read_text())
    figures = report["presets"]["cpu-small"]
    assert set(figures["policies"]) == COMPARED_POLICIES
    assert figures["async_split"]["train_cells"] in PRESETS["cpu-small"].async_splits
    assert figures["elastic_over_async"] > 0 and figures["elastic_over_colocate"] > 0
    row = figures["policies"]["elastic"]
    for key in (
        "makespan_s",
        "idle_train",
        "idle_rollout",
        "switches",
        "lower_bound_s",
        "bound_work_s",
        "bound_chain_s",
        "over_lower_bound",
    ):
        assert key in row


def test_a_problem_share_gives_siblings_one_suite_and_a_shared_length():
    preset = dataclasses.replace(SMALL_FLAGSHIP, problem_share=0.95)
    work = sample_workload(preset)
    g = preset.group_size
    by_group = work.predicted_s.reshape(preset.steps, -1, g)
    assert (by_group == by_group[..., :1]).all()  # one prediction per problem
    assert by_group[..., 0].std() > 0  # problems differ
    tokens = work.decode_tokens.sum(axis=-1).reshape(preset.steps, -1, g)  # decode tokens ~ turns
    within = np.log(tokens).std(axis=-1).mean()
    across = np.log(tokens).mean(axis=-1).std()
    assert within < across / 2  # siblings are alike, problems are not
    assert sample_workload(SMALL_FLAGSHIP).predicted_s is None  # no per-problem part: nothing to predict
    with pytest.raises(ValueError, match=r"problem_share is 1\.5"):
        sample_workload(dataclasses.replace(SMALL_FLAGSHIP, problem_share=1.5))


def test_oracle_order_starts_each_step_longest_first():
    preset = dataclasses.replace(SMALL_FLAGSHIP, dispatch_order="oracle")
    simulation = Simulation(preset, make_policy("elastic", **preset.elastic))
    result = simulation.run("elastic-oracle", 2)
    assert result.makespan_s >= result.bound.seconds
    work = simulation.work
    for step, execs in enumerate(simulation.execs):
        started = sorted(execs, key=lambda e: (e.started, -work.batch1_s[step, e.index]))
        durations = [work.batch1_s[step, e.index] for e in started]
        assert durations == sorted(durations, reverse=True)


def test_dispatch_order_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="needs a workload with a per-problem part"):
        Simulation(dataclasses.replace(SMALL_FLAGSHIP, dispatch_order="predicted"), make_policy("elastic"))
    with pytest.raises(ValueError, match="choose group, predicted or oracle"):
        Simulation(dataclasses.replace(SMALL_FLAGSHIP, dispatch_order="shortest"), make_policy("elastic"))
    preset = dataclasses.replace(SMALL_FLAGSHIP, problem_share=0.9, dispatch_order="predicted")
    simulation = Simulation(preset, make_policy("elastic", **preset.elastic))
    for step, execs in enumerate(simulation.execs):
        keys = [simulation.work.predicted_s[step, e.index] for e in execs]
        assert keys == sorted(keys, reverse=True)
        members = [e.index // preset.group_size for e in execs]
        assert all(members.count(m) == preset.group_size for m in set(members))
        runs = [m for i, m in enumerate(members) if i == 0 or members[i - 1] != m]
        assert len(runs) == len(set(members))  # a group's members are dispatched together


def test_on_shared_cores_the_update_competes_with_the_engines():
    """On cores the cells share (a CPU machine without partitioning; the CPU presets own theirs
    since 2026-12-06) the update, CPU work like any other, takes longer while engines decode (async
    overlaps them), and the run reports how busy it kept the cores."""
    work = sample_workload(SMALL_TAIL, 3)
    slow = dataclasses.replace(
        SMALL_TAIL,
        trainer=dataclasses.replace(SMALL_TAIL.trainer, update_s=20.0),
        cluster=dataclasses.replace(SMALL_TAIL.cluster, shared_cores=2),
    )
    async_ = make_policy("async", train_cells=2)
    shared = simulate(slow, async_, "async", 2, work)
    assert 0 < shared.cpu_busy <= 1
    apart = dataclasses.replace(slow, cluster=dataclasses.replace(slow.cluster, shared_cores=None))
    # the same campaign on cells that do not share cores: the 20 s updates no longer slow down
    assert shared.makespan_s > simulate(apart, async_, "async", 2, work).makespan_s
    assert run(SMALL_FLAGSHIP, "colocate").cpu_busy is None  # GPU cells do not share cores
