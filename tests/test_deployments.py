"""The scheduled campaigns: prefect.yaml parses and checks, and a deployment runs through a real process
worker against a real local Prefect server; a run whose step failed after its executions finished is
retried through the API (what the UI's Retry does) and resumes without dispatching them again."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.servers import prefect_server
from deployments.deploy import DEFAULT_FILE, ROOT, check, read_specs, worker_command


def test_the_shipped_deployments_load_validate_and_have_schedules():
    specs = read_specs(DEFAULT_FILE)
    assert [s.name for s in specs] == ["nightly", "weekly"]
    assert [s.schedules[0].cron for s in specs] == ["0 2 * * *", "0 3 * * 0"]
    assert all(s.pool == "gyre" and s.entrypoint == "flows/campaign.py:scheduled_campaign" for s in specs)
    for spec in specs:
        check(spec)  # the entrypoint loads; the parameters make a valid CampaignConfig


def test_bad_deployment_files_are_refused_with_the_reason(tmp_path):
    bad = tmp_path / "prefect.yaml"
    bad.write_text("deployments:\n  - name: x\n    entrypoint: flows/campaign.py:scheduled_campaign\n")
    with pytest.raises(ValueError, match="deployment 'x': missing or malformed field 'work_pool'"):
        read_specs(bad)
    bad.write_text(
        "deployments:\n  - name: x\n    entrypoint: flows/campaign.py:scheduled_campaign\n"
        "    work_pool: {name: p}\n    schedules: [{cron: 'not a cron'}]\n"
    )
    with pytest.raises(ValueError, match="deployment 'x'"):
        read_specs(bad)
    spec = read_specs(DEFAULT_FILE)[0]
    spec.parameters = {**spec.parameters, "overrides": {"steps": -1}}
    with pytest.raises(ValueError, match="steps"):
        check(spec)


@pytest.fixture(scope="module")
def local_server(tmp_path_factory):
    """A real `prefect server start` (SQLite in a temporary PREFECT_HOME) on loopback."""
    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as (url, env):
        yield url, env


def _wait_for(url: str, run_id: str, states: set[str], timeout_s: float = 600) -> str:
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout_s
    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            state = client.read_flow_run(run_id).state
            if state is not None and state.type.value in states:
                return state.type.value
            time.sleep(2)
    raise AssertionError(f"flow run {run_id} did not reach {states} in {timeout_s} s")


CONFIG = """
policy = "{policy}"
steps = 1
[store]
data_root = "{data}"
[packing]
token_budget = {budget}
[problems]
suites = {suites}
per_step = {per_step}
zero_signal = "keep"
[evaluation]
per_suite = 1
[dispatch]
group_size = 2
concurrency = 2
timeout_s = 60
[dispatch.durations]
short_turns = 1
long_fraction = 0.0
[dispatch.harness]
max_tokens = {max_tokens}
max_retries = 0
max_subagents = 0
[serving]
trainer_threads = 1
"""


def campaign_config(policy, data, *, budget: int, suites='["terminal"]', per_step=1, max_tokens=24) -> str:
    """A one-step campaign of the policy folder ``policy`` storing under ``data``, small and quick;
    ``suites`` as TOML."""
    return CONFIG.format(
        policy=policy, data=data, budget=budget, suites=suites, per_step=per_step, max_tokens=max_tokens
    )


@pytest.mark.slow
def test_a_deployment_runs_through_a_worker_and_a_failed_step_retried_resumes(local_server, tmp_path):
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.deploy import register
    from engines.model import ModelConfig, init_model
    from trajectory_store.storage import Store, StoreConfig

    url, env = local_server
    policy = tmp_path / "policy"
    init_model(ModelConfig(preset="tiny", seed=0), str(policy))
    config = tmp_path / "campaign.toml"
    data = tmp_path / "data"
    # a token budget below any prompt: the step's executions finish, then packing fails
    config.write_text(campaign_config(policy, data, budget=16))
    spec = tmp_path / "prefect.yaml"
    spec.write_text(
        "deployments:\n  - name: test\n    entrypoint: flows/campaign.py:scheduled_campaign\n"
        f"    parameters: {{config_path: '{config}', name: t, overrides: {{}}}}\n"
        "    work_pool: {name: gyre-test}\n"
    )
    worker_env = {**env, "PREFECT_API_URL": url, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    with temporary_settings({PREFECT_API_URL: url}):
        assert list(register(spec)) == ["scheduled-campaign/test"]
        worker = subprocess.Popen(
            worker_command("gyre-test"),
            cwd=ROOT,
            env=worker_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            run = run_deployment("scheduled-campaign/test", timeout=0)
            run_id = str(run.id)
            assert _wait_for(url, run_id, {"FAILED", "CRASHED", "COMPLETED"}) == "FAILED"
            store = StoreConfig(data_root=str(data), campaign=f"t-{run_id.split('-')[0]}")
            before = Store(store).read_table("executions").to_pylist()
            calls_before = Store(store).read_table("calls").num_rows
            assert sorted(r["step"] for r in before) == [0, 0]

            config.write_text(campaign_config(policy, data, budget=4096))  # the fix
            retry = subprocess.run(
                [str(Path(sys.executable).parent / "prefect"), "flow-run", "retry", run_id],
                env=worker_env,
                capture_output=True,
                text=True,
                check=False,
            )
            assert retry.returncode == 0, retry.stdout + retry.stderr
            assert _wait_for(url, run_id, {"FAILED", "CRASHED", "COMPLETED"}) == "COMPLETED"
        finally:
            worker.terminate()  # cleanup (what is checked is above): a worker slow to stop is killed
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
    after = Store(store).read_table("executions").to_pylist()
    assert sorted(r["execution_id"] for r in after) == sorted(r["execution_id"] for r in before)
    assert Store(store).read_table("calls").num_rows == calls_before  # nothing ran again
    assert (data / "campaigns" / store.campaign / "steps" / "step=0.json").exists()


VICTIM = """
import time
from prefect import flow

@flow(name="zombie-victim")
def victim():
    print("running", flush=True)
    time.sleep(600)

victim()
"""


@pytest.mark.slow
def test_a_flow_whose_process_is_killed_is_marked_crashed(local_server):
    """Prefect alone leaves it RUNNING forever; gyre's automation (stack/zombies.py, installed by
    `gyre up` and `gyre deploy`) sets it CRASHED once its heartbeats stop, so a Retry can resume it."""
    import asyncio
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from stack.zombies import ensure_zombie_automation, heartbeat_env

    url, env = local_server

    async def runs() -> list:
        async with get_client() as client:
            return await client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=["zombie-victim"]))
            )

    async def remove(automation_id: str) -> None:  # 40 s is for this test only: other flows on
        async with get_client() as client:  # this server beat every 180 s by default
            await client.delete_automation(UUID(automation_id))

    with temporary_settings({PREFECT_API_URL: url}):
        first = asyncio.run(ensure_zombie_automation(silent_s=40))
        assert asyncio.run(ensure_zombie_automation(silent_s=40)) == first  # installed once, by name
        victim = subprocess.Popen(
            [sys.executable, "-c", VICTIM],
            env={**env, "PREFECT_API_URL": url, **heartbeat_env()},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert victim.stdout.readline().strip() == "running"
            time.sleep(5)  # the first heartbeat goes out as the run starts: let it reach the server
            [run] = asyncio.run(runs())
            assert run.state.type.value == "RUNNING"
            victim.kill()
            victim.wait()
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                [run] = asyncio.run(runs())
                if run.state.type.value != "RUNNING":
                    break
                time.sleep(3)
        finally:
            victim.kill()
            asyncio.run(remove(first))
    assert run.state.type.value == "CRASHED", run.state
    assert "no heartbeat" in (run.state.message or "")


@pytest.mark.slow
def test_a_scheduled_campaign_trains_on_a_folder_suite_beside_a_generator(prefect_harness, tmp_path):
    """What a deployment runs (scheduled_campaign on a config file): a user's problem folder, its path
    relative to the file, mixed with repo; both are trained on, the held-out problem only evaluated."""
    from flows.campaign import scheduled_campaign
    from tests.campaign_fixtures import tiny_policy
    from trajectory_store.storage import Store, StoreConfig

    grade = 'if [ -f done.txt ]; then echo \'{"passed": 1, "total": 1}\'; else echo \'{"passed": 0, "total": 1}\'; fi\n'
    for name in ("p00", "p01", "p02"):
        (tmp_path / "problems" / name).mkdir(parents=True)
        (tmp_path / "problems" / name / "instruction.md").write_text(f"Create done.txt ({name}).\n")
        (tmp_path / "problems" / name / "grade.sh").write_text(grade)
    data = tmp_path / "data"
    config = tmp_path / "campaign.toml"
    suites = '[{ name = "mine", path = "problems", held_out = ["p00"] }, "repo"]'
    config.write_text(
        campaign_config(
            tiny_policy(tmp_path / "policy"), data, budget=4096, suites=suites, per_step=2, max_tokens=16
        )
    )
    records = scheduled_campaign(config_path=str(config), name="suites")
    assert [r.step for r in records] == [0]
    (name,) = [p.name for p in (data / "campaigns").iterdir() if not p.name.endswith("-eval")]
    trained = Store(StoreConfig(data_root=str(data), campaign=name)).read_table("executions").to_pylist()
    trained_ids = {r["problem_id"] for r in trained}
    assert {i.split("-")[0] for i in trained_ids} == {"mine", "repo"} and len(trained) == 4
    assert "mine-p00" not in trained_ids
    evaluated = Store(StoreConfig(data_root=str(data), campaign=f"{name}-eval")).read_table("executions")
    assert "mine-p00" in {r["problem_id"] for r in evaluated.to_pylist()}
    split = json.loads((data / "campaigns" / name / "suites.json").read_text())
    assert [s["name"] for s in split["suites"]] == ["mine", "repo"]
    assert list(split["suites"][0]["held_out"]) == ["mine-p00"]
