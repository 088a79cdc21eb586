"""The HTTP front: real uvicorn on a loopback port, real httpx clients."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from safetensors.torch import save_file

from engines.admin import (
    ENGINE_SLEEP,
    ENGINE_STATS,
    EXPORT_SESSION,
    IMPORT_SESSION,
    AdminClient,
    AdminError,
    EngineStatsReport,
    SleepState,
)
from engines.rollout import EngineConfig, GenerateRequest, RolloutEngine, SamplingParams, ShmTransport
from engines.rollout.server import create_app
from tests.test_gateway_fixtures import serving as serve_app
from tests.test_rollout_fixtures import perturbed_state, tiny_policy

TOKEN = "s3cret-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.usefixtures("one_thread")


def engine_stats(url: str) -> EngineStatsReport:
    with AdminClient(engine_token=TOKEN) as admin:
        return admin.engine_stats(url)


@contextlib.contextmanager
def serving(engine: RolloutEngine):
    with serve_app(create_app(engine, admin_token=TOKEN, model_name="tiny")) as (url, _):
        yield url


@pytest.fixture(scope="module")
def model():
    return tiny_policy()


@pytest.fixture
def server(model):
    with serving(RolloutEngine(model, EngineConfig(engine_id="A"))) as url:
        yield url


def completion(prompt, **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    body.update(return_tokens_as_token_ids=True, return_token_ids=True, **fields)
    return body


def test_completions_shape_and_concurrent_requests_are_batched(server):
    prompts = [[(7 * i + j) % 64 for j in range(5 + i)] for i in range(6)]

    async def call_all():
        async with httpx.AsyncClient(base_url=server, timeout=60) as client:
            calls = [
                client.post("/v1/completions", json=completion(p, max_tokens=40, seed=i))
                for i, p in enumerate(prompts)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(call_all())
    assert [r.status_code for r in responses] == [200] * 6
    body = responses[0].json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length" and len(choice["token_ids"]) == 40
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert len(choice["logprobs"]["token_logprobs"]) == 40 and choice["gyre"]["policy_versions"] == [0] * 40
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 40,
        "total_tokens": 45,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    stats = engine_stats(server)
    assert stats.max_running > 1  # concurrent HTTP requests shared decode forwards
    assert stats.decoded_tokens == 240 and stats.decode_steps < 240


def test_session_id_reuses_the_prefix_cache_and_lists_of_prompts(server):
    first = httpx.post(f"{server}/v1/completions", json=completion([1, 2, 3, 4, 5, 6], session_id="s")).json()
    output = first["choices"][0]["token_ids"]
    second = httpx.post(
        f"{server}/v1/completions", json=completion([1, 2, 3, 4, 5, 6, *output, 9, 9], session_id="s")
    ).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 + 8 - 1
    assert second["choices"][0]["gyre"]["prefilled_tokens"] == 3
    both = httpx.post(f"{server}/v1/completions", json=completion([[1, 2, 3], [4, 5]])).json()
    assert [c["index"] for c in both["choices"]] == [0, 1] and both["usage"]["prompt_tokens"] == 5
    models = httpx.get(f"{server}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and httpx.get(f"{server}/health").status_code == 200


def test_bad_requests_get_400(server):
    for body in (
        completion("a string prompt"),
        completion([1, 2], n=2),
        completion([1, 2], stream=True),
        completion([[1], [2]], session_id="s"),
        completion([1, 64]),
        completion([]),
    ):
        response = httpx.post(f"{server}/v1/completions", json=body)
        assert response.status_code == 400, body
        assert "message" in response.json()["error"]


def test_admin_refuses_a_missing_or_wrong_token(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        assert httpx.get(ENGINE_STATS.url(server), headers=headers).status_code == 401
        assert httpx.post(ENGINE_SLEEP.url(server), headers=headers).status_code == 401
    assert httpx.get(ENGINE_STATS.url(server), headers=ADMIN).status_code == 200
    with AdminClient(engine_token="wrong") as admin, pytest.raises(AdminError) as refused:
        admin.sleep(server)
    assert refused.value.status == 401


def test_admin_weights_sleep_wake(server, model, tmp_path):
    path = tmp_path / "policy-v3.safetensors"
    state = {k: v.contiguous() for k, v in perturbed_state(model, seed=4).items() if k != "lm_head.weight"}
    save_file(state, path, metadata={"version": "3"})
    with AdminClient(engine_token=TOKEN) as admin:
        assert admin.load_weights(server, str(path)).policy_version == 3  # the file's version
        out = httpx.post(f"{server}/v1/completions", json=completion([3, 1, 4], session_id="w")).json()
        assert out["choices"][0]["gyre"]["policy_versions"] == [3] * 8
        assert admin.sleep(server).asleep is True
        assert admin.wake(server, str(path), 5) == SleepState(asleep=False, policy_version=5)
        again = httpx.post(f"{server}/v1/completions", json=completion([3, 1, 4], session_id="w2")).json()
        assert again["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]
        stats = admin.engine_stats(server)
    assert stats.weight_updates == 1 and stats.policy_version == 5 and stats.weights_path == str(path)


def test_export_import_between_two_servers(server, model):
    prompt = [2, 7, 1, 8, 2, 8, 1, 8]
    first = httpx.post(f"{server}/v1/completions", json=completion(prompt, session_id="mv")).json()
    handle = httpx.post(EXPORT_SESSION.url(server), headers=ADMIN, json={"session_id": "mv"}).json()
    assert handle["kind"] == "shm" and handle["session_id"] == "mv"
    with serving(RolloutEngine(model, EngineConfig(engine_id="B"))) as other:
        imported = httpx.post(IMPORT_SESSION.url(other), headers=ADMIN, json={"handle": handle})
        assert imported.json() == {"session_id": "mv", "request_id": None}
        turn2 = prompt + first["choices"][0]["token_ids"] + [4]
        out = httpx.post(f"{other}/v1/completions", json=completion(turn2, session_id="mv")).json()
        assert out["choices"][0]["gyre"]["prefilled_tokens"] == 2  # the last output token + the new one
        assert out["choices"][0]["gyre"]["engine_id"] == "B"
        stats = engine_stats(other)
        assert stats.migrations_in == 1 and stats.prefilled_tokens == 2
    missing = httpx.post(EXPORT_SESSION.url(server), headers=ADMIN, json={"session_id": "mv"})
    assert missing.status_code == 404


def test_export_over_tcp_is_fetched_once_from_the_exporting_server(server, model):
    """transport=tcp (another host): the handle names the exporting server's URL, the importer streams
    the KV from there (no shared file) and decodes on without a prefill; the buffer serves once, only
    with the admin token, and a handle of an unknown kind or a gone buffer is a clear error."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = httpx.post(f"{server}/v1/completions", json=completion(prompt, session_id="net")).json()
    body = {"session_id": "net", "transport": "tcp"}
    handle = httpx.post(EXPORT_SESSION.url(server), headers=ADMIN, json=body).json()
    assert handle["kind"] == "tcp" and handle["url"].startswith(f"{server}/admin/kv/")
    assert handle["nbytes"] == handle["header"]["nbytes"] > 0
    assert httpx.get(handle["url"]).status_code == 401  # the KV is the engines' business only
    with serving(RolloutEngine(model, EngineConfig(engine_id="B"))) as other:
        imported = httpx.post(IMPORT_SESSION.url(other), headers=ADMIN, json={"handle": handle})
        assert imported.json() == {"session_id": "net", "request_id": None}
        turn2 = prompt + first["choices"][0]["token_ids"] + [4]
        out = httpx.post(f"{other}/v1/completions", json=completion(turn2, session_id="net")).json()
        assert out["choices"][0]["gyre"]["prefilled_tokens"] == 2  # nothing of the moved context
        # the same turn on A's own KV, had it stayed: the same tokens
        again = httpx.post(f"{server}/v1/completions", json=completion(turn2)).json()
        assert out["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
        gone = httpx.post(IMPORT_SESSION.url(other), headers=ADMIN, json={"handle": handle})
        assert gone.status_code == 502 and "did not arrive" in gone.text and "404" in gone.text
        odd = httpx.post(
            IMPORT_SESSION.url(other), headers=ADMIN, json={"handle": {**handle, "kind": "rdma"}}
        )
        assert odd.status_code == 400 and "'rdma'" in odd.text


def test_request_in_flight_moves_to_another_server(model):
    """The gateway's move: A's request is exported mid-decode (A answers 'migrated' with the tokens so
    far), imported on B with wait=true (B answers the whole completion: exactly the unmigrated one)."""
    prompt = [5, 9, 2, 6, 5, 3, 5]
    fields = dict(session_id="live", max_tokens=60, temperature=1.0, seed=3)
    a, b = (
        RolloutEngine(model, EngineConfig(engine_id="A")),
        RolloutEngine(model, EngineConfig(engine_id="B")),
    )
    with serving(a) as a_url, serving(b) as b_url:

        async def move():
            async with httpx.AsyncClient(timeout=60) as client:
                with a._lock:  # A's engine loop cannot step meanwhile: the export lands mid-decode for sure
                    call = asyncio.create_task(
                        client.post(f"{a_url}/v1/completions", json=completion(prompt, **fields))
                    )
                    while not a.has_unfinished():
                        await asyncio.sleep(0.005)
                    while not a.running or len(a.running[0].output_ids) < 5:
                        assert a.step() == []
                    handle = ShmTransport().send(a.export_session("live"))
                partial = (await call).json()
                body = {"handle": handle.model_dump(), "wait": True}
                finished = await client.post(IMPORT_SESSION.url(b_url), headers=ADMIN, json=body)
                return partial, finished.json()

        partial, finished = asyncio.run(move())
        b_stats = engine_stats(b_url).model_dump()
    moved = partial["choices"][0]["token_ids"]
    assert partial["choices"][0]["finish_reason"] == "migrated" and len(moved) == 5
    choice = finished["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"][:5] == moved
    assert choice["gyre"]["migrated"] and choice["gyre"]["engine_id"] == "B"
    assert b_stats["prefilled_tokens"] == 0 and b_stats["migrations_in"] == 1
    sampling = SamplingParams(temperature=1.0, seed=3, max_tokens=60)
    unmigrated = RolloutEngine(model, EngineConfig()).generate(
        [GenerateRequest(request_id="u", prompt_ids=prompt, sampling=sampling)]
    )[0]
    assert choice["token_ids"] == unmigrated.output_ids
