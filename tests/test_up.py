"""`gyre up` / status / down on real processes: a Prefect server with its UI, an engine and the gateway,
recorded by pid; a campaign uses the running stack (and runs beside a stack of another policy, which it
leaves running); down stops exactly what up started."""

from __future__ import annotations

import httpx
import pytest

from stack.up import (
    ServiceRecord,
    ServingConfig,
    UpRecord,
    down,
    read_record,
    runs_beside,
    state_dir,
    status,
    up,
)
from tests.campaign_fixtures import tiny_campaign, tiny_policy


@pytest.mark.slow
def test_up_serves_a_campaign_and_down_stops_only_what_it_started(prefect_harness, tmp_path):
    from flows.campaign import campaign

    policy = tiny_policy(tmp_path / "policy")
    data_root = str(tmp_path / "data")
    serving = ServingConfig(trainer_threads=1)
    record = up(data_root, policy, serving, prefect_port=0, gateway_port=0, engine_port=0)
    try:
        assert [s.name for s in record.services] == ["prefect", "engine-0", "gateway"]
        assert oct((state_dir(data_root) / "services.json").stat().st_mode & 0o777) == "0o600"
        assert all(row["running"] and row["healthy"] for row in status(data_root))
        assert httpx.get(record.prefect_ui_url, timeout=10, follow_redirects=True).status_code == 200
        assert up(data_root, policy, serving, prefect_port=0, gateway_port=0, engine_port=0) == record  # kept

        problems = {"zero_signal": "top_up", "top_up_rounds": 1}
        config = tiny_campaign("up", policy, data_root, problems=problems)
        records = campaign(config)
        assert [r.version for r in records] == [1]
        # a random policy earns 0 everywhere: the step was topped up once, then its groups skipped
        metrics = records[0].metrics
        assert metrics["executions"] == 4 and metrics["groups"] == 2
        assert metrics["executions_zero_signal"] == 4 and metrics["executions_trained"] == 0
        assert metrics["trained"] == 0.0
        # the calls went through the running gateway: its engine's id is in them, and it still runs
        engine_port = record.engine_urls[0].rsplit(":", 1)[1]
        from trajectory_store.storage import Store, StoreConfig

        calls = Store(StoreConfig(data_root=data_root, campaign="up")).read_table("calls")
        assert set(calls.column("engine_id").to_pylist()) == {f"rollout-{engine_port}"}
        assert all(row["healthy"] for row in status(data_root))
    finally:
        stopped = down(data_root)
    assert stopped == ["gateway", "engine-0", "prefect"]
    assert read_record(data_root) is None and status(data_root) == []
    from stack.up import _alive

    assert not any(_alive(service) for service in record.services)  # each pid gone or another program


@pytest.mark.slow
def test_a_service_that_dies_is_started_again_where_it_was_and_its_engine_taken_back(
    prefect_harness, tmp_path
):
    """SIGKILLed, an engine and then the gateway are started again by `revive` (what `gyre up --watch`
    and `gyre run` call every few seconds) on their addresses with their tokens; the engine serves
    what its sibling serves, and the gateway, which found it dead, takes it back at the next serve."""
    import asyncio
    import os
    import signal
    import time

    from openai import OpenAI
    from prefect.settings import PREFECT_API_URL
    from pydantic import SecretStr

    from environments.gateway_admin import GatewayAdmin
    from stack.campaign import Services, readd_dead_engines, serve_version
    from stack.up import revivals, revive

    policy = tiny_policy(tmp_path / "policy")
    data_root = str(tmp_path / "data")
    serving = ServingConfig(engines=2, trainer_threads=1)
    url = PREFECT_API_URL.value()
    record = up(data_root, policy, serving, prefect_api_url=url, gateway_port=0, engine_port=0)
    try:
        services = Services(
            gateway_url=record.gateway_url,
            admin_token=SecretStr(record.admin_token),
            engine_urls=record.engine_urls,
            engine_admin_token=SecretStr(record.engine_admin_token),
            policy_root=str(tmp_path / "campaign"),
            fast_dir=str(tmp_path / "fast"),
        )
        assert set(serve_version(services, record.engine_urls, 3, policy).values()) == {"swapped"}
        victim = next(s for s in record.services if s.name == "engine-1")
        os.kill(victim.pid, signal.SIGKILL)
        engine_id = f"rollout-{victim.url.rsplit(':', 1)[1]}"

        async def register() -> dict:
            async with httpx.AsyncClient() as http:
                return await GatewayAdmin(record.gateway_url, record.admin_token, http).register("x")

        registration = asyncio.run(register())
        client = OpenAI(base_url=registration["base_url"], api_key=registration["api_key"], max_retries=0)
        for agent in range(4):  # new sessions go to the least loaded engine: some try the dead one
            out = client.chat.completions.create(
                model="gyre-policy",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_headers={"X-Gyre-Agent": f"a{agent}"},
            )
            assert out.model_extra["gyre"]["engine_id"] != engine_id
        stats = httpx.get(
            f"{record.gateway_url}/admin/stats", headers={"Authorization": f"Bearer {record.admin_token}"}
        ).json()
        assert {e["engine_id"]: e["state"] for e in stats["engines"]}[engine_id] == "dead"

        assert revive(data_root) == ["engine-1"]
        again = next(s for s in read_record(data_root).services if s.name == "engine-1")
        assert again.url == victim.url and again.pid != victim.pid and again.starts == 2
        engine = httpx.get(
            f"{victim.url}/admin/stats", headers={"Authorization": f"Bearer {record.engine_admin_token}"}
        ).json()
        assert engine["policy_version"] == 3 and engine["weights_path"] == policy  # like its sibling
        assert readd_dead_engines(services, record.engine_urls) == [engine_id]
        assert readd_dead_engines(services, record.engine_urls) == []  # once

        gateway = next(s for s in read_record(data_root).services if s.name == "gateway")
        os.kill(gateway.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while revive(data_root) != ["gateway"]:
            assert time.monotonic() < deadline, "the gateway was not started again"
            time.sleep(0.2)
        assert [(r["name"], r["starts"]) for r in revivals(data_root)] == [("engine-1", 2), ("gateway", 2)]
        deadline, seen = time.monotonic() + 30, []
        while {"engine-1", "gateway"} - set(seen) and time.monotonic() < deadline:  # the UI's event feed
            events = httpx.post(
                f"{url}/events/filter", json={"filter": {"event": {"name": ["gyre.service.revived"]}}}
            ).json()["events"]
            seen = [e["resource"]["prefect.resource.name"] for e in events]
            time.sleep(0.5)
        assert {"engine-1", "gateway"} <= set(seen), seen
        assert all(row["running"] and row["healthy"] for row in status(data_root))
        stats = httpx.get(
            f"{record.gateway_url}/admin/stats", headers={"Authorization": f"Bearer {record.admin_token}"}
        )
        assert stats.status_code == 200  # the same address and admin token the campaign holds
        assert up(
            data_root, policy, serving, prefect_api_url=url, gateway_port=0, engine_port=0
        ).services == (read_record(data_root).services)  # kept
    finally:
        down(data_root)


def _record(policy: str, *, engine: str = "gyre", serving: bool = True) -> UpRecord:
    """A record of `gyre up`'s stack: a Prefect server and, with ``serving``, an engine and the gateway."""
    from stack.serving import ENGINE_MARKERS

    services = [ServiceRecord(name="prefect", pid=1, url="http://127.0.0.1:1/api", marker="server", log="")]
    if serving:
        services += [
            ServiceRecord(name="engine-0", pid=2, url="http://e", marker=ENGINE_MARKERS[engine], log=""),
            ServiceRecord(name="gateway", pid=3, url="http://g", marker="engines.gateway", log=""),
        ]
    return UpRecord(
        data_root="d",
        policy=policy,
        prefect_api_url="http://127.0.0.1:1/api",
        prefect_ui_url=None,
        gateway_url="http://g",
        admin_token="t",
        engine_urls=["http://e"] if serving else [],
        engine_admin_token="t",
        services=services,
        started_at=0.0,
    )


def test_a_campaign_runs_on_the_stack_of_its_policy_and_beside_a_stack_of_another():
    """The decision `gyre run` takes (stack/up.py campaign_stack): on gyre up's stack when it
    serves the campaign's policy with the campaign's engine, beside it (its own engines and gateway, the
    shared Prefect server and UI left running) when it serves another; no stack, or a Prefect server
    alone: `up` starts what the campaign needs."""
    assert not runs_beside(None, "a", "gyre")
    assert not runs_beside(_record("a"), "a", "gyre")
    assert runs_beside(_record("a"), "b", "gyre")
    assert runs_beside(_record("a"), "a", "vllm")
    assert runs_beside(_record("a", engine="vllm"), "a", "gyre")
    assert not runs_beside(_record("", serving=False), "b", "gyre")


@pytest.mark.slow
def test_a_campaign_of_another_policy_runs_beside_the_stack_and_gyre_up_keeps_the_prefect_server(
    prefect_harness, tmp_path
):
    """Starting a campaign of policy B while gyre up serves policy A restarts nothing: the campaign
    rolls out on engines of its own (none of its calls reaches A's engine) and A's stack still runs;
    `gyre up` for B then replaces the engines and the gateway, and keeps the Prefect server and its UI."""
    from flows.campaign import campaign
    from stack.up import _alive, campaign_stack, running_stack
    from trajectory_store.storage import Store, StoreConfig

    first, other = tiny_policy(tmp_path / "a"), tiny_policy(tmp_path / "b")
    data_root = str(tmp_path / "data")
    serving = ServingConfig(trainer_threads=1)
    ports = {"prefect_port": 0, "gateway_port": 0, "engine_port": 0}
    record = up(data_root, first, serving, **ports)
    try:
        used, shared = campaign_stack(data_root, other, serving, **ports)
        assert not shared and used == record  # its Prefect server; nothing stopped, nothing started
        assert running_stack(data_root, other) is None  # so the campaign starts engines of its own

        campaign(tiny_campaign("beside", other, data_root))
        calls = Store(StoreConfig(data_root=data_root, campaign="beside")).read_table("calls")
        stack_engine = f"rollout-{record.engine_urls[0].rsplit(':', 1)[1]}"
        assert calls.num_rows and stack_engine not in set(calls.column("engine_id").to_pylist())
        assert read_record(data_root) == record
        assert all(row["running"] and row["healthy"] for row in status(data_root))

        again = up(data_root, other, serving, **ports)
        prefect = next(s for s in record.services if s.name == "prefect")
        assert again.policy == other and again.services[0] == prefect
        assert again.prefect_ui_url == record.prefect_ui_url
        assert [s.name for s in again.services] == ["prefect", "engine-0", "gateway"]
        assert not any(_alive(s) for s in record.services[1:])  # A's engine and gateway stopped
        assert all(row["running"] and row["healthy"] for row in status(data_root))
    finally:
        down(data_root)
