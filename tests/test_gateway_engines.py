"""Engines behind the gateway, over real HTTP: one id per engine everywhere (the engine's own, read from
its /v1/models without any admin token: in /admin/stats, in responses and in recorded calls), conflicting
ids refused; and the command-line servers' start banners and the gateway's access log (off by default)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time

import httpx
import pytest

from engines.gateway import EngineSpec, Gateway, GatewayConfig
from engines.gateway.app import create_app
from engines.model.tokenizer import save_tokenizer
from engines.net import free_port
from engines.rollout import EngineConfig, RolloutEngine
from engines.rollout.server import create_app as engine_app
from tests.test_gateway_fixtures import (
    ADMIN,
    ADMIN_TOKEN,
    ENGINE_TOKEN,
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


def test_an_engine_is_known_by_its_own_id_everywhere_and_conflicts_are_refused(tmp_path, model, caplog):
    folder = str(tmp_path / "tokenizer")
    save_tokenizer(tokenizer(), folder)
    store = StoreConfig(data_root=str(tmp_path / "store"), campaign="ids")
    config_of = lambda engine_id: EngineConfig(engine_id=engine_id, max_model_len=8192)  # noqa: E731
    caplog.set_level(logging.INFO, logger="engines.gateway.access")
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
    assert not [r for r in caplog.records if r.name == "engines.gateway.access"]  # the access log is off


def _wait_for(url: str, process: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, f"{url} exited: {log_path.read_text()[-2000:]}"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{url} did not start: {log_path.read_text()[-2000:]}"
        time.sleep(0.2)


def test_the_servers_print_a_start_banner_and_the_gateway_an_access_log(tmp_path, model):
    folder = tmp_path / "scripted"
    model.save_pretrained(folder)
    save_tokenizer(tokenizer(), folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    engine_log, gateway_log = tmp_path / "engine.log", tmp_path / "gateway.log"
    engine_cmd = [sys.executable, "-m", "engines.rollout.server", "--model", str(folder)]
    engine_cmd += ["--port", str(engine_port), "--admin-token", ENGINE_TOKEN]  # no --engine-id
    gateway_cmd = [sys.executable, "-m", "engines.gateway", "--model", str(folder), "--engine", engine_url]
    gateway_cmd += ["--port", str(gateway_port), "--admin-token", ADMIN_TOKEN, "--access-log"]
    gateway_cmd += ["--data-root", str(tmp_path / "data"), "--campaign", "banner-test", "--step", "3"]
    processes = []
    try:
        with engine_log.open("wb") as out:
            processes.append(subprocess.Popen(engine_cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        _wait_for(engine_url, processes[0], engine_log)
        with gateway_log.open("wb") as out:
            processes.append(subprocess.Popen(gateway_cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        _wait_for(gateway_url, processes[1], gateway_log)

        engine_id = f"rollout-{engine_port}"  # the default id: unique per port on a host
        (engine_banner,) = [
            line for line in engine_log.read_text().splitlines() if "gyre rollout engine" in line
        ]
        assert f"gyre rollout engine {engine_id} on {engine_url}: model {folder}" in engine_banner
        assert "admin API on" in engine_banner
        (gateway_banner,) = [line for line in gateway_log.read_text().splitlines() if "gyre gateway" in line]
        assert f"gyre gateway on {gateway_url}: engines {engine_id} {engine_url};" in gateway_banner
        assert f"data root {tmp_path / 'data'}, campaign banner-test, step 3" in gateway_banner
        assert "access log on" in gateway_banner

        registration = httpx.post(
            f"{gateway_url}/admin/executions", headers=ADMIN, json={"execution_id": "banner-1"}
        ).json()
        answer = chat(registration)
        assert answer.status_code == 200 and answer.json()["gyre"]["engine_id"] == engine_id
        stats = httpx.get(f"{gateway_url}/admin/stats", headers=ADMIN).json()
        assert [e["engine_id"] for e in stats["engines"]] == [engine_id]
        assert httpx.get(f"{gateway_url}/nowhere").status_code == 404
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=30)
    log = gateway_log.read_text()
    completion = [line for line in log.splitlines() if '"POST /x/banner-1/v1/chat/completions" 200' in line]
    assert len(completion) == 1 and "ms (engine " in completion[0]
    assert '"GET /nowhere" 404' in log and '"POST /admin/executions" 200' in log
    assert registration["api_key"] not in log and ADMIN_TOKEN not in log  # never a key
