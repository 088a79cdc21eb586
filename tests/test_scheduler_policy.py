"""scheduler/policy.py: each policy on hand-built states, then property tests on random state
sequences driven by a toy controller (capacity, the core, staleness, no flapping)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.policy import (
    Async,
    AsyncConfig,
    CellState,
    Colocate,
    Decision,
    Elastic,
    ElasticConfig,
    SchedulerState,
    StepProgress,
    dispatchable,
    make_policy,
)


def cells(
    rollout: int, train: int = 0, sessions: tuple[int, ...] = (), since: float = -1e9
) -> tuple[CellState, ...]:
    """The core (train) first, then `train` satellites, then `rollout` cells with `sessions`."""
    out = [CellState("core", "train", core=True, since=since)]
    out += [CellState(f"t{i}", "train", since=since) for i in range(train)]
    loads = list(sessions) + [0] * (rollout - len(sessions))
    out += [CellState(f"r{i}", "rollout", since=since, active_sessions=loads[i]) for i in range(rollout)]
    return tuple(out)


def state(pool: tuple[CellState, ...], waterlevel: int = 0, queued: int = 0, **kw: object) -> SchedulerState:
    version = kw.pop("policy_version", 0)
    steps = kw.pop("steps", (StepProgress(version, executions=queued + waterlevel, dispatched=waterlevel),))
    base = {"now": 0.0, "cells": pool, "sessions_per_cell": 4, "dispatched": waterlevel, "finished": 0}
    return SchedulerState(**{**base, "steps": steps, "policy_version": version, **kw})


# ---- Elastic ------------------------------------------------------------------------------------


def test_elastic_moves_idle_cells_to_training_while_capacity_covers_the_waterlevel():
    # 4 rollout cells x 4 sessions, 5 unfinished: two cells host them with half a cell of headroom
    pool = cells(rollout=4, sessions=(3, 2, 0, 0))
    decision = Elastic(ElasticConfig(gain_factor=0)).decide(state(pool, waterlevel=5))
    assert decision.roles == {"r2": "train", "r3": "train"}  # the empty cells leave first
    assert decision.dispatch == ()


def test_elastic_keeps_headroom_before_a_cell_leaves():
    pool = cells(rollout=2, sessions=(4, 3))
    policy = Elastic(ElasticConfig(gain_factor=0, hysteresis=0.5))
    assert policy.decide(state(pool, waterlevel=3)).roles == {}  # 1 cell x 4 - 3 < 0.5 x 4
    assert policy.decide(state(pool, waterlevel=2)).roles == {"r1": "train"}


def test_elastic_switches_only_when_the_backlog_pays_for_it():
    pool = cells(rollout=3)
    policy = Elastic(ElasticConfig(gain_factor=1.0))
    assert policy.decide(state(pool, train_backlog_s=0.0)).roles == {}
    # 1 train cell: gain of a second = 60 / 2 = 30 s > 12 s; of a third = 60 / 6 = 10 s < 12 s
    assert policy.decide(state(pool, train_backlog_s=60.0)).roles == {"r0": "train"}


def test_elastic_pulls_satellites_back_for_new_work_and_dispatches_into_ready_cells():
    pool = cells(rollout=1, train=2)
    decision = Elastic().decide(state(pool, queued=10))
    assert decision.roles == {"t0": "rollout", "t1": "rollout"}
    assert [(d.step, d.executions) for d in decision.dispatch] == [(0, 4)]  # only r0 is ready now


def test_elastic_respects_the_dwell_time():
    pool = cells(rollout=1, train=1, since=0.0)
    policy = Elastic(ElasticConfig(min_dwell_s=60))
    assert policy.decide(state(pool, queued=8, now=30.0)).roles == {}
    assert policy.decide(state(pool, queued=8, now=61.0)).roles == {"t0": "rollout"}


def test_elastic_puts_a_core_found_in_rollout_back_to_training():
    pool = (CellState("core", "rollout", core=True), CellState("r0", "rollout"))
    assert Elastic().decide(state(pool)).roles["core"] == "train"


def test_elastic_trains_the_current_step_before_rolling_out_the_next():
    pool = cells(rollout=3)
    ahead = (StepProgress(0, 8, dispatched=8, finished_groups=2), StepProgress(1, 8))
    decision = Elastic().decide(
        state(pool, waterlevel=0, steps=ahead, dispatched=8, finished=8, train_backlog_s=500.0)
    )
    assert "train" in decision.roles.values()
    assert sum(d.executions for d in decision.dispatch) <= 4 * (3 - len(decision.roles))


def lending(**kw: object) -> Elastic:
    return Elastic(ElasticConfig(**{"gain_factor": 0.0, "min_dwell_s": 0.0, "lend_core": True, **kw}))


def test_a_lent_core_rolls_out_while_the_step_rolls_out_its_bulk():
    # step 0: 16 executions, 8 running on r0 and r1 (4 sessions each), 8 queued; nothing finished
    pool = cells(rollout=2, sessions=(4, 4))
    bulk = state(pool, waterlevel=8, queued=8)
    decision = lending().decide(bulk)
    assert decision.roles == {"core": "rollout"}
    assert Elastic(ElasticConfig(gain_factor=0, min_dwell_s=0)).decide(bulk).roles == {}  # not lent: stays


def test_a_lent_core_leaves_training_only_with_its_satellites():
    pool = cells(rollout=2, train=1, sessions=(4, 4))
    decision = lending().decide(state(pool, waterlevel=8, queued=8))
    assert decision.roles == {"t0": "rollout", "core": "rollout"}
    # a satellite still dwelling keeps training, so the core stays with it
    dwelling = (*cells(rollout=2, sessions=(4, 4)), CellState("t0", "train", since=50.0))
    held = lending(min_dwell_s=30).decide(state(dwelling, waterlevel=8, queued=8, now=60.0))
    assert held.roles == {}


def test_a_lent_core_trains_from_its_steps_tail_once_the_others_host_every_session():
    lent = (
        CellState("core", "rollout", core=True, active_sessions=2),
        *cells(rollout=2, sessions=(4, 1))[1:],
    )
    # step 0's last 3 executions of 16 run, 13 finished (3 groups of 4 in): the others can host them
    # and 4 of step 1 run too: 7 unfinished in all
    tail = (
        StepProgress(0, 16, dispatched=16, finished_groups=3, finished=13),
        StepProgress(1, 16, dispatched=4),
    )
    busy = state(lent, steps=tail, dispatched=20, finished=13)
    decision = lending().decide(busy)
    assert decision.roles == {"core": "train"}
    # with more sessions than the others hold, the core waits, and no new work starts on it
    crowded = state(lent, steps=tail, dispatched=23, finished=13)
    waiting = lending().decide(crowded)
    assert waiting.roles == {}
    assert sum(d.executions for d in waiting.dispatch) == 0  # 2 cells x 4 sessions hold 10 already


def test_a_lent_core_trains_while_its_step_is_closed_or_done():
    lent = (CellState("core", "rollout", core=True), *cells(rollout=2)[1:])
    # step 0 closed (its update runs): the window starts at step 1, and version 0 is still served
    closed = state(lent, waterlevel=0, steps=(StepProgress(1, 16),), policy_version=0)
    assert lending().decide(closed).roles == {"core": "train"}
    done = state(lent, steps=(StepProgress(0, 16, dispatched=16, finished_groups=4, finished=16),))
    assert lending().decide(done).roles == {"core": "train"}


# ---- Colocate and Async -------------------------------------------------------------------------


def test_colocate_flips_the_whole_pool():
    pool = cells(rollout=3)
    rolling = Colocate().decide(state(pool, waterlevel=4))
    assert rolling.roles == {"core": "rollout"}
    done = state(pool, steps=(StepProgress(0, 4, dispatched=4, finished_groups=1),), dispatched=4, finished=4)
    assert Colocate().decide(done).roles == {"r0": "train", "r1": "train", "r2": "train"}
    trained = tuple(replace(c, role="train") for c in pool)
    after = state(trained, policy_version=1, steps=(StepProgress(1, 4),), dispatched=4, finished=4)
    assert set(Colocate().decide(after).roles.values()) == {"rollout"}


def test_async_holds_a_static_split_and_overlaps_one_step():
    pool = cells(rollout=4)
    steps = (StepProgress(0, 4, dispatched=4), StepProgress(1, 4), StepProgress(2, 4))
    decision = Async(AsyncConfig(train_cells=2)).decide(state(pool, waterlevel=4, steps=steps))
    assert decision.roles == {"r0": "train"}
    assert [(d.step, d.executions) for d in decision.dispatch] == [(1, 4)]  # step 2 would be lag 2
    with pytest.raises(ValueError, match="train_cells"):
        Async(AsyncConfig(train_cells=5)).decide(state(pool))


def test_dispatchable_stops_while_carried_work_is_past_the_bound():
    steps = (StepProgress(3, 4),)
    assert dispatchable(state(cells(1), steps=steps, policy_version=3, oldest_behaviour_version=2), 2, 1)
    assert not dispatchable(state(cells(1), steps=steps, policy_version=3, oldest_behaviour_version=1), 2, 1)


def test_make_policy_names_and_settings():
    assert isinstance(make_policy("elastic", depth=1), Elastic)
    assert isinstance(make_policy("colocate"), Colocate)
    assert make_policy("async", train_cells=3).config.train_cells == 3
    with pytest.raises(ValueError, match="choose one of elastic, colocate, async"):
        make_policy("greedy")
    with pytest.raises(ValueError, match="has no setting"):
        make_policy("colocate", depth=2)
    # [scheduler] params come as floats (a config's `train_cells = 2` is 2.0): a whole number takes its int
    from scheduler.config import SchedulerConfig

    params = SchedulerConfig(policy="async", params={"train_cells": 2}).params
    assert params == {"train_cells": 2.0} and make_policy("async", **params).config.train_cells == 2
    assert type(make_policy("elastic", depth=2.0).config.depth) is int
    with pytest.raises(ValueError, match=r"train_cells is a whole number; got 1\.5"):
        make_policy("async", train_cells=1.5)


# ---- property tests on random sequences ---------------------------------------------------------


@dataclass
class Tick:
    state: SchedulerState
    decision: Decision


def drive(
    policy, rng: random.Random, n_cells: int, cap: int, n_steps: int = 5, step_size: int = 12
) -> list[Tick]:
    """A toy controller: switches take 10 s, executions finish at random, a step trains once its
    executions have all finished. Returns every (state, decision) until the last step trains
    (or 400 ticks)."""
    pool = [CellState("core", "train", core=True)] + [
        CellState(f"c{i:02d}", "rollout") for i in range(1, n_cells)
    ]
    dispatched, finished = [0] * n_steps, [0] * n_steps
    live: list[int] = []  # behaviour versions of unfinished executions
    version, now, history = 0, 0.0, []
    for _ in range(400):
        if version == n_steps:
            break
        now += rng.choice([1.0, 5.0, 20.0, 90.0])
        pool = [
            replace(c, phase="ready") if c.phase == "switching" and now - c.since >= 10 else c for c in pool
        ]
        for step in range(n_steps):
            for _ in range(rng.randint(0, dispatched[step] - finished[step])):
                finished[step] += 1
                live.remove(rng.choice(live))
        window = range(version, min(n_steps, version + 3))
        snapshot = SchedulerState(
            now=now,
            cells=tuple(pool),
            sessions_per_cell=cap,
            dispatched=sum(dispatched),
            finished=sum(finished),
            steps=tuple(
                StepProgress(s, step_size, dispatched[s], finished[s] // 4, finished[s]) for s in window
            ),
            policy_version=version,
            oldest_behaviour_version=min(live) if live else None,
            train_backlog_s=rng.choice([0.0, 10.0, 1000.0]),
        )
        decision = policy.decide(snapshot)
        history.append(Tick(snapshot, decision))
        pool = [
            replace(c, role=decision.roles[c.cell_id], phase="switching", since=now)
            if c.cell_id in decision.roles
            else c
            for c in pool
        ]
        for order in decision.dispatch:
            dispatched[order.step] += order.executions
            live += [version] * order.executions
        if finished[version] == step_size and rng.random() < 0.5:
            version += 1
    return history


def check_capacity_core_and_staleness(
    history: list[Tick], depth: int, max_lag: int, core_trains: bool
) -> None:
    for tick in history:
        s, d = tick.state, tick.decision
        staying = [
            c for c in s.cells if c.role == "rollout" and c.phase == "ready" and c.cell_id not in d.roles
        ]
        if s.waterlevel > 0:
            assert len(staying) >= 1, "no rollout cell left while executions are unfinished"
            assert len(staying) * s.sessions_per_cell >= s.waterlevel, (
                "the cells left cannot host the sessions"
            )
        assert sum(o.executions for o in d.dispatch) <= len(staying) * s.sessions_per_cell - s.waterlevel
        for order in d.dispatch:
            assert 0 <= order.step - s.policy_version <= max_lag
            assert order.step < s.policy_version + depth
        if core_trains:
            assert all(d.roles.get(c.cell_id, "train") == "train" for c in s.cells if c.core)
            if tick is not history[0]:
                assert all(c.role == "train" for c in s.cells if c.core)


POOL = {"seed": st.integers(0, 2**32 - 1), "n_cells": st.integers(2, 10), "cap": st.integers(1, 6)}


@settings(max_examples=60, deadline=None)
@given(
    **POOL,
    depth=st.integers(1, 3),
    max_lag=st.integers(0, 2),
    hysteresis=st.sampled_from([0.0, 0.5, 1.0]),
    dwell=st.sampled_from([0.0, 30.0, 120.0]),
    gain=st.sampled_from([0.0, 1.0]),
)
def test_elastic_properties(seed, n_cells, cap, depth, max_lag, hysteresis, dwell, gain):
    config = ElasticConfig(
        depth=depth, max_policy_lag=max_lag, hysteresis=hysteresis, min_dwell_s=dwell, gain_factor=gain
    )
    history = drive(Elastic(config), random.Random(seed), n_cells, cap)
    check_capacity_core_and_staleness(history, depth, max_lag, core_trains=True)
    assert len(history) < 400, "the campaign did not finish"
    last_switch: dict[str, float] = {}
    for tick in history:
        for cell_id in tick.decision.roles:
            if cell_id in last_switch:
                assert tick.state.now - last_switch[cell_id] >= dwell, f"{cell_id} flapped"
            last_switch[cell_id] = tick.state.now


@settings(max_examples=60, deadline=None)
@given(**POOL, dwell=st.sampled_from([0.0, 30.0]), hysteresis=st.sampled_from([0.0, 0.5]))
def test_elastic_lending_the_core_properties(seed, n_cells, cap, dwell, hysteresis):
    """Capacity and staleness hold, the campaign ends, no cell flaps, and a satellite never trains
    without the core (its step is the core's)."""
    history = drive(lending(min_dwell_s=dwell, hysteresis=hysteresis), random.Random(seed), n_cells, cap)
    check_capacity_core_and_staleness(history, depth=2, max_lag=1, core_trains=False)
    assert len(history) < 400, "the campaign did not finish"
    last_switch: dict[str, float] = {}
    for tick in history:
        after = {c.cell_id: tick.decision.roles.get(c.cell_id, c.role) for c in tick.state.cells}
        core = next(c.cell_id for c in tick.state.cells if c.core)
        if any(role == "train" for cell_id, role in after.items() if cell_id != core):
            assert after[core] == "train", "a satellite trains while the core rolls out"
        for cell_id in tick.decision.roles:
            if cell_id in last_switch:
                assert tick.state.now - last_switch[cell_id] >= dwell, f"{cell_id} flapped"
            last_switch[cell_id] = tick.state.now


@settings(max_examples=40, deadline=None)
@given(**POOL)
def test_colocate_properties(seed, n_cells, cap):
    history = drive(Colocate(), random.Random(seed), n_cells, cap)
    check_capacity_core_and_staleness(history, depth=1, max_lag=0, core_trains=False)
    assert len(history) < 400, "the campaign did not finish"


@settings(max_examples=40, deadline=None)
@given(**POOL, split=st.integers(1, 9))
def test_async_properties(seed, n_cells, cap, split):
    policy = Async(AsyncConfig(train_cells=min(split, n_cells - 1)))
    history = drive(policy, random.Random(seed), n_cells, cap)
    check_capacity_core_and_staleness(history, depth=2, max_lag=1, core_trains=True)
    assert len(history) < 400, "the campaign did not finish"
    assert sum(len(t.decision.roles) for t in history[1:]) == 0  # the split never changes


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), level=st.integers(2, 12))
def test_elastic_does_not_flap_on_a_waterlevel_inside_the_band(seed, level):
    """A waterlevel wobbling by one session around any level moves cells at most once."""
    rng = random.Random(seed)
    policy = Elastic(ElasticConfig(hysteresis=0.5, min_dwell_s=0, gain_factor=0))
    pool = cells(rollout=4, since=0.0)
    switches = 0
    for t in range(1, 60):
        wobble = level + rng.choice([-1, 0, 1])
        decision = policy.decide(state(pool, waterlevel=min(wobble, 16), now=float(t)))
        switches += len(decision.roles)
        pool = tuple(replace(c, role=decision.roles.get(c.cell_id, c.role)) for c in pool)
    moved_once = switches <= len([c for c in pool if not c.core])
    assert moved_once
