"""The simulator's rollout and training model (sim/run.py): KV capacity in tokens, continuous
batching, the corrected lower bound and its batched work term, the calibrated paper-flagship, settings of the new fields, and
suites fitted on recorded executions."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.policy import AsyncConfig, make_policy
from sim.baselines import PaperAsync
from sim.presets import PAPER_FLAGSHIP, Cluster, EngineModel, Suite, sample_workload, with_settings
from sim.recorded import RecordedCall, RecordedExecution, suites_from_executions
from sim.run import Simulation, simulate

# one rollout step of 16 executions on one engine: 8 sessions, 40K-token contexts
ONE_ENGINE = dataclasses.replace(
    PAPER_FLAGSHIP,
    steps=1,
    groups_per_step=2,
    group_size=8,
    suites=(Suite("flat", 1.0, 40, 0.0, 300, 700, 0.5, 0.0),),
    segments=2,
    cluster=Cluster(cells=2, devices_per_cell=8),
    trainer=dataclasses.replace(PAPER_FLAGSHIP.trainer, min_cells=1),
    async_splits=(1,),
)


def _kv_for(contexts: float, preset=ONE_ENGINE) -> EngineModel:
    """The flagship engine with memory for `contexts` contexts of the suite's largest segment."""
    work = sample_workload(preset)
    tokens = contexts * float(work.context.max())
    gb = tokens * preset.engine.kv_bytes_per_token / 1e9 + preset.engine.weights_gb
    return dataclasses.replace(preset.engine, device_memory_gb=gb / (8 * preset.engine.memory_utilization))


def test_kv_capacity_limits_the_executions_an_engine_holds():
    roomy = Simulation(ONE_ENGINE, make_policy("async", train_cells=1))
    roomy.run("roomy", 2)
    flat = dataclasses.replace(ONE_ENGINE, segments=1)  # one context per execution: 20K tokens
    tight_preset = dataclasses.replace(flat, engine=_kv_for(2.5, flat))
    tight = Simulation(tight_preset, make_policy("async", train_cells=1))
    result = tight.run("tight", 2)
    assert max(e.peak_hosted for e in roomy.engines) == 8  # the sessions limit alone
    assert max(e.peak_hosted for e in tight.engines) == 2  # two 20K-token contexts fit in 50K
    assert result.waited_s > 0  # the others waited for KV room
    assert result.makespan_s >= result.bound.seconds


def test_decode_latency_grows_with_the_batch_and_its_contexts():
    engine = PAPER_FLAGSHIP.engine
    assert (
        engine.step_latency(1, 64_000)
        < engine.step_latency(8, 8 * 64_000)
        < engine.step_latency(8, 8 * 128_000)
    )
    alone = dataclasses.replace(ONE_ENGINE, groups_per_step=1, group_size=1)
    crowded = dataclasses.replace(ONE_ENGINE, groups_per_step=1, group_size=8)
    single = simulate(alone, make_policy("async", train_cells=1), "alone", 2)
    batch = simulate(crowded, make_policy("async", train_cells=1), "crowded", 2)
    # one execution alone on the engine finishes its step sooner than the same work among 7 others
    assert batch.step_span_s > 1.2 * single.step_span_s


def test_the_corrected_bound_counts_timed_out_executions_by_their_share():
    short = dataclasses.replace(ONE_ENGINE, steps=2, deadline_s=150)  # most executions time out
    work = sample_workload(short)
    for name, policy, depth in [
        ("colocate", make_policy("colocate"), 1),
        ("async", make_policy("async", train_cells=1), 2),
        ("elastic", make_policy("elastic"), 2),
    ]:
        result = simulate(short, policy, name, depth, work)
        assert result.timeouts > 0
        assert result.makespan_s >= result.bound.seconds
    from sim.result import lower_bound

    assert result.bound.work_s < lower_bound(short, work, 2).work_s  # full tokens overstate the work


def _batch1_work_s(preset, work) -> float:
    """The work term at batch-1 speed: every execution's batch-1 slot time over the cell's sessions."""
    slots = float(work.batch1_s.sum()) / preset.engine.sessions_per_cell
    train = (
        float(work.train_tokens.sum()) / preset.train_tokens_per_s + preset.steps * preset.trainer.update_s
    )
    return (slots + train) / preset.cluster.cells


def test_the_bound_batches_decode_and_stays_below_every_policy():
    """The work term counts what a continuous batch costs (sessions live longer in a fuller batch, a
    step serves more tokens, the KV cache holds their contexts): never below the batch-1 term, above
    it where engines are decode-bound, and still below the makespan of every policy."""
    from sim.result import lower_bound

    flagship = with_settings(PAPER_FLAGSHIP, ["steps=4"])
    work = sample_workload(flagship)
    bound = lower_bound(flagship, work, 2)
    assert bound.work_s >= _batch1_work_s(flagship, work)
    assert 1 < bound.batch < flagship.engine.sessions_per_cell
    decode_bound = dataclasses.replace(ONE_ENGINE, steps=2, cluster=Cluster(cells=3, devices_per_cell=8))
    work = sample_workload(decode_bound)
    assert lower_bound(decode_bound, work, 2).work_s > 1.2 * _batch1_work_s(decode_bound, work)
    whole_batches = dataclasses.replace(decode_bound, stream_training=False)
    for name, preset, policy, depth in [
        ("colocate", decode_bound, make_policy("colocate"), 1),
        ("async", decode_bound, make_policy("async", train_cells=1), 2),
        ("elastic", decode_bound, make_policy("elastic"), 2),
        ("elastic-sync", decode_bound, make_policy("elastic", depth=1, max_policy_lag=0), 1),
        (
            "async-paperlike",
            whole_batches,
            PaperAsync(AsyncConfig(train_cells=1), decode_bound.group_size),
            2,
        ),
    ]:
        result = simulate(preset, policy, name, depth, work)
        assert result.bound.batch > 1 and result.figures()["bound_batch"] == round(result.bound.batch, 2)
        assert result.makespan_s >= result.bound.seconds


def test_the_calibrated_flagship_reproduces_the_papers_baselines():
    """The full 48 steps (seconds): colocate within 10% of 91.5 h, the paper-like async (best
    split, no streaming across steps) within 10% of 134.6 h."""
    work = sample_workload(PAPER_FLAGSHIP)
    colocate = simulate(PAPER_FLAGSHIP, make_policy("colocate"), "colocate", 1, work)
    whole_batches = dataclasses.replace(PAPER_FLAGSHIP, stream_training=False)
    paperlike = simulate(
        whole_batches, PaperAsync(AsyncConfig(train_cells=8), PAPER_FLAGSHIP.group_size), "paperlike", 2, work
    )
    assert colocate.makespan_s / 3600 == pytest.approx(91.5, rel=0.10)
    assert paperlike.makespan_s / 3600 == pytest.approx(134.6, rel=0.10)
    assert paperlike.makespan_s >= paperlike.bound.seconds and colocate.makespan_s >= colocate.bound.seconds


def test_settings_reach_the_new_fields():
    changed = with_settings(
        PAPER_FLAGSHIP,
        [
            "engine.device_memory_gb=141",
            "engine.devices=4",
            "engine.prefill_tokens_per_s=5000",
            "trainer.min_cells=4",
            "trainer.mfu=0.3",
            "suites.swe.turns_median=300",
            "suites.*.gap_sigma=2",
            "context_keep=0.8",
            "stream_training=false",
        ],
    )
    assert changed.engine.device_memory_gb == 141.0 and changed.engines_per_cell == 2
    # TP4 on 141 GB devices: 4 x 141 x 0.9 GB less the weights, at 192 KB per token
    assert changed.engine.kv_capacity_tokens == pytest.approx((4 * 141 * 0.9 - 470) * 1e9 / (192 * 1024))
    assert changed.trainer.min_cells == 4 and changed.train_tokens_per_s < PAPER_FLAGSHIP.train_tokens_per_s
    assert [s.turns_median for s in changed.suites] == [300, 170, 300]
    assert all(s.gap_sigma == 2.0 for s in changed.suites)
    assert changed.context_keep == 0.8 and changed.stream_training is False
    with pytest.raises(ValueError, match="has no suite 'nope'"):
        with_settings(PAPER_FLAGSHIP, ["suites.nope.gap_sigma=1"])
    with pytest.raises(ValueError, match="a suite has no field 'bogus'"):
        with_settings(PAPER_FLAGSHIP, ["suites.*.bogus=1"])


def test_suites_are_fitted_on_recorded_executions():
    def execution(suite: str, turns: int, gap: float) -> RecordedExecution:
        calls, t, prompt = [], 0.0, 1000
        for _ in range(turns):
            calls.append(RecordedCall(prompt, 200, t, t + 4.0))
            t += 4.0 + gap
            prompt += 200 + 800  # its output and a tool result of 800 tokens
        return RecordedExecution(suite, calls, ended_at=t)

    recorded = (
        [execution("swe", 10, 2.0)] * 3
        + [execution("swe", 40, 2.0)] * 3
        + [execution("terminal", 5, 0.5)] * 2
    )
    swe, terminal = suites_from_executions(recorded)
    assert (swe.name, terminal.name) == ("swe", "terminal")
    assert swe.weight == pytest.approx(0.75) and terminal.weight == pytest.approx(0.25)
    assert swe.turns_median == pytest.approx(20.0) and swe.turns_sigma == pytest.approx(0.693, abs=1e-3)
    assert swe.output_tokens_per_turn == 200 and swe.context_tokens_per_turn == 800
    assert swe.gap_median_s == pytest.approx(2.0) and terminal.gap_median_s == pytest.approx(0.5)
    preset = dataclasses.replace(ONE_ENGINE, suites=(swe, terminal))
    assert simulate(preset, make_policy("colocate"), "colocate", 1).makespan_s > 0
    with pytest.raises(ValueError, match="no recorded execution"):
        suites_from_executions([RecordedExecution("swe", [])])
