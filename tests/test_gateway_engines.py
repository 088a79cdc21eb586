"""Engines behind the gateway, over real HTTP: one id per engine everywhere (the engine's own, read from
its /v1/models without any admin token: in /admin/stats, in responses and in recorded calls), conflicting
ids refused."""

from __future__ import annotations

import httpx
import pytest

from engines.gateway import EngineSpec, Gateway, GatewayConfig
from engines.gateway.app import create_app
from engines.model.tokenizer import save_tokenizer
from engines.rollout import EngineConfig, RolloutEngine
from engines.rollout.server import create_app as engine_app
from tests.test_gateway_fixtures import (
    ADMIN,
    ADMIN_TOKEN,
    ENGINE_TOKEN,
    free_port,
    one_cpu_thread,
    scripted_model,
    serving,
    tokenizer,
)
from trajectory_store.storage import Store, StoreConfig


@pytest.fixture(scope="module")
def model():
    return scripted_model(tokenizer())


def chat(registration: dict) -> httpx.Response:
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]}
    headers = {"Authorization": f"Bearer {registration['api_key']}"}
    return httpx.post(registration["base_url"] + "/chat/completions", json=body, headers=headers, timeout=60)


def test_an_engine_is_known_by_its_own_id_everywhere_and_conflicts_are_refused(tmp_path, model):
    folder = str(tmp_path / "tokenizer")
    save_tokenizer(tokenizer(), folder)
    store = StoreConfig(data_root=str(tmp_path / "store"), campaign="ids")
    config_of = lambda engine_id: EngineConfig(engine_id=engine_id, max_model_len=8192)  # noqa: E731
    with (
        one_cpu_thread(),
        serving(engine_app(RolloutEngine(model, config_of("A")), admin_token=ENGINE_TOKEN)) as (a_url, _),
        serving(engine_app(RolloutEngine(model, config_of("A")), admin_token=ENGINE_TOKEN)) as (twin_url, _),
    ):
        port = free_port()
        # no engine admin token: the id must come from the engine's public /v1/models
        config = GatewayConfig(
            model=folder, port=port, admin_token=ADMIN_TOKEN, engines=[EngineSpec(url=a_url)], store=store
        )
        with serving(create_app(Gateway(config)), port=port) as (url, _):
            register = httpx.post(f"{url}/admin/executions", headers=ADMIN, json={"execution_id": "e1"})
            answer = chat(register.json())
            assert answer.status_code == 200, answer.text
            assert answer.json()["gyre"]["engine_id"] == "A"
            stats = httpx.get(f"{url}/admin/stats", headers=ADMIN).json()
            assert [e["engine_id"] for e in stats["engines"]] == ["A"]

            # named otherwise than it names itself: refused, nothing changes
            renamed = httpx.post(f"{url}/admin/engines", headers=ADMIN, json={"url": a_url, "engine_id": "B"})
            assert renamed.status_code == 409 and renamed.json()["error"]["code"] == "engine_id_mismatch"
            assert "is 'A', not 'B'" in renamed.json()["error"]["message"]
            # another live engine calling itself A would take A's place: refused
            twin = httpx.post(f"{url}/admin/engines", headers=ADMIN, json={"url": twin_url})
            assert twin.status_code == 409 and twin.json()["error"]["code"] == "engine_id_taken"
            assert a_url in twin.json()["error"]["message"]
            # the same engine added again (a restart at its URL) replaces itself
            again = httpx.post(f"{url}/admin/engines", headers=ADMIN, json={"url": a_url})
            assert again.status_code == 200 and again.json()["engine_id"] == "A"
            stats = httpx.get(f"{url}/admin/stats", headers=ADMIN).json()
            assert [(e["engine_id"], e["url"], e["state"]) for e in stats["engines"]] == [
                ("A", a_url, "active")
            ]
            assert chat(register.json()).json()["gyre"]["engine_id"] == "A"

            finish = {"status": "completed", "reward": 1.0}
            httpx.post(f"{url}/admin/executions/e1/finish", headers=ADMIN, json=finish).raise_for_status()
        calls = Store(store).read_table("calls").to_pylist()
        assert [row["engine_id"] for row in calls] == ["A", "A"]
