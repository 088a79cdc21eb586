"""The RL campaign on a real Prefect (test harness), a real engine process, the gateway and the harness,
with a tiny random policy: steps make policy versions the engines then serve, a rerun resumes after the
last committed step without dispatching a finished execution again, and metrics land as Parquet."""

from __future__ import annotations

import duckdb
import pytest

from flows.config import CampaignConfig
from tasks.campaign import problems_for
from tasks.commit import committed_steps
from trajectory_store.config import SelectionConfig
from trajectory_store.db import connect
from trajectory_store.storage import Store


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from engines.model import ModelConfig, init_model

    out = tmp_path_factory.mktemp("policy") / "tiny"
    init_model(ModelConfig(preset="tiny", seed=0), str(out))
    return str(out)


def small_campaign(tmp_path, policy: str, steps: int) -> CampaignConfig:
    return CampaignConfig.model_validate(
        {
            "name": "t",
            "policy": policy,
            "steps": steps,
            "store": {"data_root": str(tmp_path / "data")},
            "packing": {"token_budget": 4096},
            # a random policy earns 0 everywhere: keep zero-signal groups so the trainer has a batch
            "problems": {"suites": ["terminal"], "per_step": 1, "zero_signal": "keep"},
            "evaluation": {"per_suite": 1},
            "dispatch": {
                "group_size": 2,
                "concurrency": 2,
                "timeout_s": 60,
                "durations": {"short_turns": 1, "long_fraction": 0.0},
                "harness": {"max_tokens": 24, "max_retries": 0, "max_subagents": 0},
            },
            "trainer": {"lr": 1e-4},
            "serving": {"trainer_threads": 1},
        }
    )


def executions_by_step(store) -> dict[int, list[str]]:
    table = Store(store).read_table("executions").to_pylist()
    found: dict[int, list[str]] = {}
    for row in table:
        found.setdefault(row["step"], []).append(row["execution_id"])
    return {k: sorted(v) for k, v in found.items()}


@pytest.mark.slow
def test_campaign_trains_versions_and_resumes_after_the_last_committed_step(
    prefect_harness, tmp_path, tiny_policy
):
    from flows.campaign import campaign, campaign_store

    config = small_campaign(tmp_path, tiny_policy, steps=2)
    records = campaign(config)
    assert [r.step for r in records] == [0, 1]
    assert [r.version for r in records] == [1, 2]
    assert all(r.metrics["trained"] == 1.0 and r.metrics["executions_packed"] == 2 for r in records)
    for r in records:  # a zero-signal group is packed (advantage 0), counts in the average, is not trained
        assert r.metrics["executions_trained"] == 2 - r.metrics["executions_zero_signal"]
    assert all(r.metrics["tokens_trained"] > 0 for r in records)
    store, eval_store = campaign_store(config)
    first = executions_by_step(store)
    assert {s: len(ids) for s, ids in first.items()} == {0: 2, 1: 2}

    # the engines served the version each step trains: every call of step n was sampled by version n
    con = connect(Store(store), SelectionConfig())
    versions = dict(con.sql("SELECT step, max(policy_version) FROM calls GROUP BY ALL").fetchall())
    assert versions == {0: 0, 1: 1}
    assert con.sql("SELECT min(policy_version) FROM calls WHERE step = 1").fetchall()[0][0] == 1

    # held-out evaluations, at the start and the end, in their own campaign, never trained on
    assert sorted(executions_by_step(eval_store)) == [0, 2]
    metrics = dict(
        con.sql(
            "SELECT name || '@' || step, value FROM metrics WHERE name IN ('version', 'eval_executions')"
        ).fetchall()
    )
    assert metrics == {"version@0": 1.0, "version@1": 2.0, "eval_executions@0": 1.0, "eval_executions@2": 1.0}

    # run again with more steps: it resumes at step 2, and steps 0-1 are not dispatched again
    config.steps = 3
    more = campaign(config)
    assert [r.step for r in more] == [2]
    after = executions_by_step(store)
    assert {s: after[s] for s in (0, 1)} == first and len(after[2]) == 2
    assert [r.step for r in committed_steps(store)] == [0, 1, 2]
    con = connect(Store(store), SelectionConfig())
    assert con.sql("SELECT min(policy_version) FROM calls WHERE step = 2").fetchall()[0][0] == 2
    campaign_dir = tmp_path / "data" / "campaigns" / "t"
    assert sorted(p.name for p in (campaign_dir / "checkpoints").iterdir()) == ["step=1", "step=2"]
    assert sorted(p.name for p in (campaign_dir / "policy").iterdir()) == ["v1", "v2", "v3"]

    # what the Prefect UI shows: a table per step, the progress and a summary with the curves as a PNG
    from prefect.artifacts import Artifact

    assert Artifact.get("t-step-2").data is not None
    assert Artifact.get("t-progress").data == 100.0
    summary = Artifact.get("t-summary").data
    assert "data:image/png;base64,iVBOR" in summary and "gyre sql --campaign t" in summary
    with pytest.raises(duckdb.Error):  # the views are read from the store, not from Prefect
        con.sql("SELECT * FROM no_such_view").fetchall()


def test_step_problems_are_deterministic_and_apart_from_the_held_out_ones():
    a = [p.problem_id for p in problems_for(["repo", "terminal"], 4, 5003, 1, 1)]
    assert a == [p.problem_id for p in problems_for(["repo", "terminal"], 4, 5003, 1, 1)]
    assert [x.split("-")[0] for x in a] == ["repo", "terminal", "repo", "terminal"]
    more = [p.problem_id for p in problems_for(["repo", "terminal"], 4, 5003, 1, 1, skip=4)]
    assert not set(a) & set(more)
    held_out = {p.problem_id for p in problems_for(["repo", "terminal"], 8, 0, 1, 1)}
    assert not held_out & set(a)


def test_a_problem_pool_is_gone_through_in_turn_and_must_hold_a_step():
    from tasks.problems import ProblemsConfig, step_problems

    config = ProblemsConfig(suites=["repo", "terminal"], per_step=2, pool=3, seed=5000)
    pool = [p.problem_id for p in problems_for(["repo", "terminal"], 3, 5000, 1, 1)]
    steps = [[p["problem_id"] for p in step_problems(config, step)] for step in range(3)]
    assert steps == [pool[0:2], [pool[2], pool[0]], pool[1:3]]  # epochs over the pool, in turn
    same = ProblemsConfig(suites=["repo"], per_step=2, pool=2)
    assert step_problems(same, 0) == step_problems(same, 7)  # pool = per_step: every step the same
    fresh = ProblemsConfig(suites=["repo"], per_step=2)
    assert step_problems(fresh, 0) != step_problems(fresh, 1)  # no pool: fresh problems per step
    with pytest.raises(ValueError, match="pool = 3 is smaller than one step's problems"):
        ProblemsConfig(per_step=2, pool=3, zero_signal="top_up", top_up_rounds=1)


def test_step_batch_leaves_out_zero_signal_groups_and_stale_executions(store_config):
    from trajectory_store.config import PackingConfig
    from trajectory_store.recorder import Recorder
    from trajectory_store.step import ZERO_SIGNAL, step_batch, step_figures

    recorder = Recorder(Store(store_config), step=3)
    rewards = {"a0": ("a", 1.0), "a1": ("a", 0.0), "b0": ("b", 0.5), "b1": ("b", 0.5), "c0": ("c", 1.0)}
    rewards["c1"] = ("c", 0.0)
    for i, (execution_id, (group, reward)) in enumerate(sorted(rewards.items())):
        version = 1 if execution_id == "c1" else 3  # c1 was sampled two versions ago
        recorder.record_call(execution_id, "main", "main", [1, 2, 3, 4 + i], [7, 8, 9], [-0.5] * 3, version)
        recorder.record_execution(execution_id, "completed", reward=reward, group_id=group, problem_id=group)
    recorder.flush()
    con = connect(Store(store_config), SelectionConfig())
    figures = step_figures(con, 3)
    assert figures["executions"] == 6 and figures["groups"] == 3
    assert figures["pass_rate"] == pytest.approx(2 / 6) and figures["mean_reward"] == pytest.approx(0.5)

    batch, counts = step_batch(
        con, PackingConfig(), 3, trained_version=3, max_policy_lag=1, skip_zero_signal=True
    )
    assert batch.skipped["b0"] == batch.skipped["b1"] == ZERO_SIGNAL
    assert batch.skipped["c1"].startswith("stale: a call of policy version 1, trained at version 3")
    assert sorted(batch.advantages) == ["a0", "a1", "c0"]
    assert counts["executions_zero_signal"] == 2 and counts["executions_stale"] == 1
    assert counts["executions_trained"] == 3
    assert {v for s in batch.sequences for v in s.policy_versions[s.loss_mask]} == {3}  # the bound holds

    kept, counts = step_batch(
        con, PackingConfig(), 3, trained_version=3, max_policy_lag=2, skip_zero_signal=False
    )
    assert counts["executions_packed"] == 6 and counts["executions_stale"] == 0
    assert counts["executions_zero_signal"] == 2 and counts["zero_signal_skipped"] == 0
    assert counts["executions_trained"] == 4  # the zero-signal group is packed (advantage 0), not trained
    assert kept.advantages["b0"] == kept.advantages["b1"] == 0.0


def test_step_progress_moves_the_artifact_as_executions_finish(prefect_harness):
    from prefect import flow
    from prefect.artifacts import Artifact, create_progress_artifact

    from environments.runner import ExecutionOutcome
    from tasks.campaign import StepProgress

    seen = []

    @flow
    def a_step() -> None:
        artifact = create_progress_artifact(0.0, key="progress-test")
        progress = StepProgress(artifact_id=artifact, total_steps=4)
        with progress.reporter(step=1, expected=2) as report:
            report(ExecutionOutcome("e0", "p", "g", "completed", 1.0, "final"))
        seen.append(Artifact.get("progress-test").data)  # the pool has finished its update
        with progress.reporter(step=1, expected=2) as report:
            report(ExecutionOutcome("e1", "p", "g", "completed", 0.0, "final"))
            report(ExecutionOutcome("e2", "p", "g", "completed", 0.0, "final"))  # more than expected
        seen.append(Artifact.get("progress-test").data)

    a_step()
    assert seen == [37.5, 50.0]  # (1 + 1/2) / 4 and (1 + 2/2) / 4, capped at the step's end


def test_choose_problems_lists_the_problems_it_chose_in_an_artifact_of_its_task_run(prefect_harness):
    """What the UI shows under `choose problems step 3 round 0`: a table of the problems drawn."""
    import json

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId

    from tasks.campaign import choose_problems
    from tasks.problems import ProblemsConfig

    @flow
    def pick() -> tuple:
        state = choose_problems(ProblemsConfig(suites=["terminal", "repo"], per_step=2), 3, return_state=True)
        return state.state_details.task_run_id, state.result()

    task_run, problems = pick()
    by_task_run = ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run]))
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=by_task_run)
    assert [a.type for a in artifacts] == ["table"]
    rows = json.loads(artifacts[0].data)
    assert [row["problem"] for row in rows] == [p["problem_id"] for p in problems]
    assert [row["problem"] for row in rows] == ["terminal-s5003-d1l1-000", "repo-s5003-d1l1-000"]
    assert [row["suite"] for row in rows] == ["terminal", "repo"] and all(row["instruction"] for row in rows)
    assert "2 problems of step 3, round 0" in artifacts[0].description
