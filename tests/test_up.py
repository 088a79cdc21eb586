"""`gyre up` / status / down on real processes: a Prefect server with its UI, an engine and the gateway,
recorded by pid; a campaign uses the running stack; down stops exactly what up started."""

from __future__ import annotations

import httpx
import pytest

from tasks.up import ServingConfig, down, read_record, state_dir, status, up
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
    from tasks.up import _alive

    assert not any(_alive(service) for service in record.services)  # each pid gone or another program
