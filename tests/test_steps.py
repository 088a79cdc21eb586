"""The one step recipe (tasks/steps.py): the step flow and the scheduler pack, count and commit alike.

A step packed group by group (the scheduler) leaves out, packs, trains and counts exactly what the
same step packed at once (the step flow) does; `zero_signal = "keep"` is honoured by both; the
scheduler's commit records the same figures and prunes checkpoints as `keep_checkpoints` says; keys
the scheduler cannot honour are refused with a reason; its messages to the flow are typed."""

from __future__ import annotations

import time

import pytest

from engines.train.run import TrainStepReport
from flows.config import CampaignConfig
from scheduler.report import Committed, Done, Heartbeat, Message, StepDone
from stack.campaign import Services
from tasks.commit import committed_steps
from tasks.problems import EvaluationConfig
from tasks.steps import CampaignSteps, StepsConfig, pack
from trajectory_store.config import PackingConfig
from trajectory_store.recorder import Recorder
from trajectory_store.step import ANOTHER_GROUP, add_counts
from trajectory_store.storage import Store

STEP = 3
# group -> (member execution id, reward, the policy version its call was sampled with)
GROUPS = {
    "s3-a": [("a0", 1.0, 3), ("a1", 0.0, 3)],
    "s3-b": [("b0", 0.5, 3), ("b1", 0.5, 3)],  # zero signal
    "s3-c": [("c0", 1.0, 3), ("c1", 0.0, 1)],  # c1 is stale at max_policy_lag 1
    "s3-d": [("d0", 1.0, 3), ("d1", 0.0, 3), ("d2", None, 3)],  # d2 ended in error: untrainable
}


def _record(store_config) -> None:
    recorder = Recorder(Store(store_config), step=STEP)
    for i, (group, members) in enumerate(sorted(GROUPS.items())):
        for j, (execution_id, reward, version) in enumerate(members):
            prompt = [1, 2, 3, 10 * i + j + 4]
            recorder.record_call(execution_id, "main", "main", prompt, [7, 8, 9], [-0.5] * 3, version)
            status = "completed" if reward is not None else "error"
            recorder.record_execution(execution_id, status, reward=reward, group_id=group, problem_id=group)
    recorder.flush()


def _recipe(store_config, zero_signal: str) -> StepsConfig:
    return StepsConfig(
        policy="unused",
        max_policy_lag=1,
        store=store_config,
        problems={"zero_signal": zero_signal},
        packing=PackingConfig(),
    )


COUNTS = [
    "executions_trained",
    "executions_packed",
    "executions_zero_signal",
    "executions_stale",
    "executions_untrainable",
    "tokens_trained",
    "zero_signal_skipped",
]  # tokens_packed and sequences depend on what is packed together: one group cannot share another's context


@pytest.mark.parametrize("zero_signal", ["skip", "keep"])
def test_a_step_packed_group_by_group_counts_what_the_whole_step_counts(store_config, zero_signal):
    _record(store_config)
    recipe = _recipe(store_config, zero_signal)
    whole = pack(recipe, STEP)
    chunks = {group: pack(recipe, STEP, group) for group in GROUPS}
    summed: dict[str, float] = {}
    for chunk in chunks.values():
        summed = add_counts(summed, chunk.figures)
    assert {k: summed[k] for k in COUNTS} == {k: whole.figures[k] for k in COUNTS}
    assert whole.executions == sum(c.executions for c in chunks.values())
    assert summed["tokens_packed"] >= whole.figures["tokens_packed"]
    assert whole.figures["executions_stale"] == 1 and whole.figures["executions_zero_signal"] == 2
    assert whole.figures["executions_untrainable"] == 1
    # a zero-signal group is a chunk with nothing trained: left out (skip) or packed at advantage 0 (keep)
    if zero_signal == "skip":
        assert chunks["s3-b"].uri is None and whole.figures["executions_packed"] == 5
    else:
        assert chunks["s3-b"].uri and chunks["s3-b"].figures["executions_packed"] == 2
        assert chunks["s3-b"].figures["executions_trained"] == 0
    assert whole.figures["executions_trained"] == 5  # a0, a1, c0, d0, d1
    assert all(Store(store_config).fs.exists(c.uri) for c in chunks.values() if c.uri)


def test_a_group_packs_none_of_the_other_groups_executions(store_config):
    from trajectory_store.db import connect
    from trajectory_store.step import step_batch

    _record(store_config)
    con = connect(Store(store_config))
    batch, counts = step_batch(
        con,
        PackingConfig(),
        STEP,
        trained_version=STEP,
        max_policy_lag=1,
        skip_zero_signal=True,
        group="s3-c",
    )
    con.close()
    assert sorted(batch.advantages) == ["c0"]
    assert batch.skipped["c1"].startswith("stale")
    assert {batch.skipped[e] for e in ("a0", "a1", "b0", "b1", "d0", "d1", "d2")} == {ANOTHER_GROUP}
    assert counts["executions_stale"] == 1 and counts["executions_untrainable"] == 0


def _report(step: int, url: str) -> TrainStepReport:
    return TrainStepReport(
        step=step,
        version=step + 1,
        trained=True,
        metrics={"loss": 0.5},
        checkpoint_url=f"{url}/checkpoints/step={step}",
        policy_uri=f"{url}/policy/v{step + 1}",
        policy_path="unused",
        seconds=1.0,
    )


def _done(step: int, figures: dict[str, float]) -> StepDone:
    now = time.time()
    return StepDone(step, step + 1, 4, 2, 1, 1.0, 1.0, 2.0, now - 2, now - 1, now, {}, figures)


def test_the_schedulers_commit_records_the_step_flows_figures_and_keeps_the_newest_checkpoints(store_config):
    _record(store_config)
    recipe = _recipe(store_config, "skip").model_copy(update={"keep_checkpoints": 1})
    target = Store(store_config)
    services = Services(
        gateway_url="http://127.0.0.1:9",
        admin_token="a",
        engine_urls=[],
        engine_admin_token="b",
        policy_root=target.url(target.campaign_dir),
        fast_dir="/nonexistent",
    )
    steps = CampaignSteps(recipe, services)
    for step in (0, 1, STEP):
        target.write_bytes(target.path(f"checkpoints/step={step}/model.bin"), b"weights")
        chunk = pack(recipe, step)
        assert (
            steps.commit(_done(step, chunk.figures), _report(step, target.url(target.campaign_dir)), [])
            == step + 1
        )
    flow_figures = pack(recipe, STEP).figures
    record = committed_steps(store_config)[-1]
    assert record.step == STEP
    for name in [*COUNTS, "executions", "mean_reward", "groups"]:
        assert name in record.metrics, name
    assert {k: record.metrics[k] for k in COUNTS} == {k: flow_figures[k] for k in COUNTS}
    assert record.metrics["groups_trained"] == 2 and record.metrics["groups_skipped"] == 1
    kept = [s for s in (0, 1, STEP) if target.fs.exists(target.path(f"checkpoints/step={s}"))]
    assert kept == [STEP]  # keep_checkpoints = 1, as the step flow prunes


def test_a_campaign_key_the_scheduler_cannot_honour_is_refused_with_its_reason():
    base = {"scheduler": {"policy": "elastic"}, "trainer": {"mini_batches": 1, "epochs": 1}}
    with pytest.raises(ValueError, match='zero_signal = "top_up" with \\[scheduler\\]'):
        CampaignConfig.model_validate({**base, "problems": {"zero_signal": "top_up"}})
    for honoured in ("skip", "keep"):
        config = CampaignConfig.model_validate(
            {**base, "problems": {"zero_signal": honoured}, "keep_checkpoints": 1, "evaluation": {"every": 2}}
        )
        assert config.problems.zero_signal == honoured
    CampaignConfig.model_validate({"problems": {"zero_signal": "top_up"}})  # the step flow tops up


def test_the_scheduler_runs_on_hosts_and_refuses_what_it_does_not_do_there_with_its_reason():
    hosts = [{"name": "a", "address": "10.0.0.1", "cells": 2}, {"name": "b", "address": "10.0.0.2"}]
    base = {"scheduler": {"policy": "elastic"}, "trainer": {"mini_batches": 1, "epochs": 1}}
    on_hosts = CampaignConfig.model_validate(
        {**base, "cluster": {"hosts": hosts, "gateway_address": "10.0.0.9"}}
    )
    assert on_hosts.cluster is not None and on_hosts.scheduler.policy == "elastic"
    for cluster, reason in [
        ({"hosts": [hosts[1]]}, "at least 2 cells"),
        (
            {"hosts": hosts, "core_hosts": ["b"]},
            "core_hosts = \\['b'\\]: the scheduler's core is one process",
        ),
        ({"hosts": hosts, "gateways": 2}, "gateways = 2: the scheduler dispatches through one gateway"),
    ]:
        with pytest.raises(ValueError, match=reason):
            CampaignConfig.model_validate({**base, "cluster": cluster})


def test_evaluation_is_due_every_n_versions_and_at_the_last():
    assert [v for v in range(1, 8) if EvaluationConfig(every=3).due(v, 7)] == [3, 6, 7]
    assert [v for v in range(1, 5) if EvaluationConfig().due(v, 4)] == [4]


def test_scheduler_messages_are_typed_both_ways():
    beat = Heartbeat(
        t=1.5,
        version=2,
        dispatched=4,
        finished=3,
        roles={"cell-0": "train"},
        switching=[],
        errors=0,
        wall=9.0,
    )
    for message in (
        Message(heartbeat=beat),
        Message(committed=Committed(step=1, version=2, wall=3.0)),
        Message(done=Done(version=2, switches=[{"cell": "cell-1", "to": "train", "s": 0.5}], errors=[])),
    ):
        assert Message.parse(message.line()) == message
    for bad in ('{"heartbeat": 1}', "{}", '{"committed": {"step": 1}}', "not json"):
        with pytest.raises(ValueError, match="scheduler message"):
            Message.parse(bad)
    both = Message(
        committed=Committed(step=1, version=2, wall=3.0), done=Done(version=2, switches=[], errors=[])
    )
    with pytest.raises(ValueError, match="one of heartbeat, committed, done"):
        Message.parse(both.line())
