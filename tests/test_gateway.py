"""The gateway end to end with the official `openai` client: two real rollout engine servers and the
gateway on loopback ports, a scripted tiny Qwen2 (tests/test_gateway_fixtures.py), and the calls read
back from the trajectory store."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
import textwrap

import httpx
import numpy as np
import openai
import pytest

from tests.test_gateway_fixtures import (
    ADMIN,
    TEXT_SCRIPT_TOKENS,
    TOOLS,
    gateway_stack,
    one_cpu_thread,
    scripted_model,
    scripts,
    tokenizer,
)
from trajectory_store.storage import Store


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    limits = {"max_prompt_tokens": 2000, "max_request_bytes": 256 * 1024, "max_tokens_cap": 4096}
    with (
        one_cpu_thread(),
        gateway_stack(str(tmp_path_factory.mktemp("gw")), scripted_model(tokenizer()), limits=limits) as s,
    ):
        yield s


@pytest.fixture(scope="module")
def script():
    tok = tokenizer()
    tool, text = scripts(tok)
    return {"tool": tool, "text": text, "text_content": tok.decode(text, skip_special_tokens=True)}


def test_chat_turns_are_recorded_token_exactly(stack, script):
    registration = stack.register("chat-1", problem_id="p1", group_id="g1")
    client = stack.client(registration)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say something."},
    ]
    for i in range(3):
        out = client.chat.completions.create(model="gyre-policy", messages=messages, seed=i, logprobs=i == 0)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert choice.message.content == script["text_content"]
        assert out.usage.completion_tokens == TEXT_SCRIPT_TOKENS + 1  # the stop token is generated too
        assert out.model_extra["gyre"]["call_id"] == i
        if i == 0:
            assert len(choice.logprobs.content) == TEXT_SCRIPT_TOKENS
        messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": f"And {i}?"}]
    assert stack.finish("chat-1")["calls"] == 3

    calls = stack.calls("chat-1")
    assert [row["call_id"] for row, _ in calls] == [0, 1, 2]
    tok = tokenizer()
    first_prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert calls[0][1][: calls[0][0]["prompt_len"]] == tok.encode(first_prompt, add_special_tokens=False)
    for (_, earlier), (row, sequence) in itertools.pairwise(calls):
        assert (
            sequence[: row["prompt_len"]][: len(earlier)] == earlier
        )  # prompt k+1 extends prompt k + output k
    engines = {row["engine_id"] for row, _ in calls}
    assert len(engines) == 1 and engines <= {"A", "B"}  # session affinity
    for row, sequence in calls:
        assert sequence[row["prompt_len"] :] == script["text"]
        assert (row["agent_id"], row["role"], row["policy_version"]) == ("main", "main", 0)
        assert row["finish_reason"] == "stop" and row["migrated"] is False
        assert len(row["output_logprobs"]) == row["output_len"] and max(row["output_logprobs"]) <= 0
        assert row["t_start"] <= row["t_end"]
    executions = Store(stack.store_config).read_table("executions").to_pylist()
    (execution,) = [e for e in executions if e["execution_id"] == "chat-1"]
    assert (execution["status"], execution["reward"], execution["n_calls"]) == ("completed", 1.0, 3)
    assert (execution["problem_id"], execution["group_id"]) == ("p1", "g1")


def test_tool_calls_are_parsed_and_the_next_request_reuses_the_exact_assistant_ids(stack, script):
    client = stack.client(stack.register("tools-1"))
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="gyre-policy", messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (
        call.type == "function"
        and call.function.name == "search"
        and json.loads(call.function.arguments) == {}
    )
    echoed = choice.message.model_dump(exclude_none=True)
    echoed["tool_calls"][0]["function"]["arguments"] = "{ }"  # a harness re-serializing the arguments
    messages += [echoed, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
    second = client.chat.completions.create(model="gyre-policy", messages=messages, tools=TOOLS)
    assert second.choices[0].message.tool_calls[0].id != call.id
    none = client.chat.completions.create(
        model="gyre-policy", messages=messages, tools=TOOLS, tool_choice="none"
    )
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content
    stack.finish("tools-1")

    (row0, seq0), (_, seq1), _ = stack.calls("tools-1")
    assert seq0[row0["prompt_len"] :] == script["tool"]
    assert seq1[: len(seq0)] == seq0
    assert second.model_extra["gyre"]["reused_prompt_tokens"] == len(seq0) + 1  # + the "\n" closing the turn
    assert stack.gateway.stats.retokenized_assistant_messages == 0


def test_streaming_chat_and_tool_calls(stack, script):
    client = stack.client(stack.register("stream-1"))
    messages = [{"role": "user", "content": "Stream please."}]
    chunks = list(
        client.chat.completions.create(
            model="gyre-policy", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == script["text_content"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == TEXT_SCRIPT_TOKENS + 1
    tool_chunks = list(
        client.chat.completions.create(model="gyre-policy", messages=messages, tools=TOOLS, stream=True)
    )
    deltas = [d for c in tool_chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["search"] and deltas[0].id.startswith("call_")
    assert tool_chunks[-1].choices[0].finish_reason == "tool_calls"
    stack.finish("stream-1")
    assert len(stack.calls("stream-1")) == 2


def test_sub_agents_and_roles(stack):
    registration = stack.register("agents-1")
    main = stack.client(registration)
    researcher = stack.client(registration, agent="researcher")
    by_key = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=registration["api_key"], max_retries=0)
    ask = [{"role": "user", "content": "Go."}]
    main.chat.completions.create(model="m", messages=ask, max_tokens=4)
    researcher.chat.completions.create(model="m", messages=ask, max_tokens=4)
    main.chat.completions.create(
        model="m", messages=ask, max_tokens=4, extra_headers={"X-Gyre-Role": "main_summary"}
    )
    researcher.chat.completions.create(
        model="m", messages=ask, max_tokens=4, extra_body={"gyre_role": "sub_summary"}
    )
    by_key.chat.completions.create(
        model="m", messages=ask, max_tokens=4, extra_headers={"X-Gyre-Agent": "critic"}
    )
    sessions = set(stack.gateway.router.sessions)
    assert {"agents-1/main", "agents-1/researcher", "agents-1/critic"} <= sessions
    stack.finish("agents-1")
    calls = stack.calls("agents-1")
    assert [(row["agent_id"], row["role"]) for row, _ in calls] == [
        ("main", "main"),
        ("researcher", "sub"),
        ("main", "main_summary"),
        ("researcher", "sub_summary"),
        ("critic", "sub"),
    ]
    assert all(row["finish_reason"] == "length" and row["output_len"] == 4 for row, _ in calls)


def test_sessions_stay_on_their_engine_and_new_ones_go_to_the_least_loaded(stack):
    router = stack.gateway.router
    assert [len(e.sessions) for e in router.engines.values()] == [0, 0]  # earlier executions finished
    engines = {}
    for name in ("affinity-1", "affinity-2"):
        client = stack.client(stack.register(name))
        messages = [{"role": "user", "content": "Hi."}]
        for turn in range(3):
            out = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
            messages += [
                out.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"{turn}"},
            ]
        engines[name] = {row["engine_id"] for row, _ in stack.calls(name)}
    assert all(len(e) == 1 for e in engines.values())  # every call of a session on one engine
    assert engines["affinity-1"] != engines["affinity-2"]  # the second session went to the idle engine
    stats = {e: stack.engine_stats(e) for e in ("A", "B")}
    assert all(s["cached_tokens"] > 0 for s in stats.values())  # later turns hit the engine's prefix cache
    for name in engines:
        stack.finish(name)


def test_auth_errors_and_bad_input_answer_openai_style(stack):
    registration = stack.register("errors-1")
    client = stack.client(registration)
    ask = [{"role": "user", "content": "x"}]

    def error_of(exc_type, **kwargs):
        with pytest.raises(exc_type) as caught:
            (kwargs.pop("using", client)).chat.completions.create(model="m", max_tokens=2, **kwargs)
        assert set(caught.value.body) == {"message", "type", "param", "code"}
        return caught.value

    wrong = openai.OpenAI(base_url=registration["base_url"], api_key="not-the-key", max_retries=0)
    assert error_of(openai.AuthenticationError, using=wrong, messages=ask).status_code == 401
    unknown = openai.OpenAI(base_url=f"{stack.url}/x/no-such/v1", api_key="k", max_retries=0)
    assert "unknown execution" in error_of(openai.NotFoundError, using=unknown, messages=ask).message
    assert (
        error_of(openai.BadRequestError, messages=[{"role": "robot", "content": "x"}]).body["param"]
        == "messages.0.role"
    )
    assert error_of(openai.BadRequestError, messages=ask, n=2).body["param"] == "n"
    bad_role = error_of(openai.BadRequestError, messages=ask, extra_headers={"X-Gyre-Role": "boss"})
    assert bad_role.body["param"] == "gyre_role"
    long = error_of(openai.BadRequestError, messages=[{"role": "user", "content": "word " * 3000}])
    assert long.body["code"] == "context_length_exceeded" and "2000" in long.message
    huge = error_of(openai.APIStatusError, messages=[{"role": "user", "content": "y" * 300_000}])
    assert huge.status_code == 413 and huge.body["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as out_of_vocab:
        client.completions.create(model="m", prompt=[1, 2, 10**6], max_tokens=2)
    assert out_of_vocab.value.body["param"] == "prompt"

    raw = httpx.post(
        registration["base_url"] + "/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {registration['api_key']}", "Content-Type": "application/json"},
    )
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{stack.url}/nowhere").json()["error"]["type"] == "not_found_error"
    assert httpx.post(f"{stack.url}/admin/flush").status_code == 401
    assert httpx.post(f"{stack.url}/admin/flush", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.models.list().data[0].id == "gyre-policy"

    stack.finish("errors-1", status="error", reward=0.0)
    assert "has finished" in error_of(openai.NotFoundError, messages=ask).message
    assert stack.calls("errors-1") == []  # refused requests never reach an engine or the store


HARNESS = textwrap.dedent(
    """
    import json
    import sys

    from openai import OpenAI


    def run(base_url, api_key, tools):
        client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Plan a trip."}]
        for step in range(3):
            reply = client.chat.completions.create(model="gyre-policy", messages=messages, tools=tools, seed=step)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {step}"})
        messages.append({"role": "user", "content": "Now answer in words."})
        final = client.chat.completions.create(model="gyre-policy", messages=messages, max_tokens=8)
        return final.choices[0].finish_reason


    if __name__ == "__main__":
        print(json.dumps(run(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
    """
)


def test_an_external_harness_subprocess_is_recorded_like_an_in_process_one(stack, tmp_path):
    path = tmp_path / "harness.py"
    path.write_text(HARNESS)
    outside = stack.register("harness-subprocess")
    done = subprocess.run(
        [sys.executable, str(path), outside["base_url"], outside["api_key"], json.dumps(TOOLS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == "length"
    inside = stack.register("harness-in-process")
    spec = importlib.util.spec_from_file_location("harness", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    assert harness.run(inside["base_url"], inside["api_key"], TOOLS) == "length"
    stack.finish("harness-subprocess")
    stack.finish("harness-in-process")

    theirs, ours = stack.calls("harness-subprocess"), stack.calls("harness-in-process")
    assert len(theirs) == len(ours) == 4
    for (row_a, seq_a), (row_b, seq_b) in zip(theirs, ours, strict=True):
        for field in (
            "call_id",
            "agent_id",
            "role",
            "prompt_len",
            "output_len",
            "finish_reason",
            "policy_version",
        ):
            assert row_a[field] == row_b[field]
        assert seq_a == seq_b
        np.testing.assert_allclose(row_a["output_logprobs"], row_b["output_logprobs"], atol=1e-6)
    for (_, earlier), (_, sequence) in itertools.pairwise(theirs[:3]):
        assert sequence[: len(earlier)] == earlier


def test_completions_take_text_or_token_ids_and_return_token_ids(stack):
    registration = stack.register("completions-1")
    client = stack.client(registration)
    tokens = client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=20, seed=3, logprobs=1)
    choice = tokens.choices[0]
    assert choice.finish_reason == "length" and len(choice.model_extra["token_ids"]) == 20
    assert len(choice.logprobs.token_logprobs) == 20
    text = client.completions.create(model="m", prompt="Once upon a time", max_tokens=5)
    streamed = list(
        client.completions.create(model="m", prompt="Once upon a time", max_tokens=5, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text or True
    stack.finish("completions-1")
    calls = stack.calls("completions-1")
    assert calls[0][1][:4] == [5, 6, 7, 8] and calls[0][1][4:] == choice.model_extra["token_ids"]
    expected = tokenizer().encode("Once upon a time", add_special_tokens=False)
    assert calls[1][1][: calls[1][0]["prompt_len"]] == expected


def test_stop_strings_cut_the_output_and_the_record_keeps_what_was_sampled(stack, script):
    tok = tokenizer()
    text = script["text"]
    single = next(t for t in text[3:] if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    multi = tok.decode(text[20:23])
    client = stack.client(stack.register("stops-1"))
    ask = [{"role": "user", "content": "Talk."}]
    by_token = client.chat.completions.create(model="m", messages=ask, stop=[tok.decode([single])])
    by_text = client.chat.completions.create(model="m", messages=ask, stop=multi)
    stack.finish("stops-1")
    (row_a, seq_a), (row_b, seq_b) = stack.calls("stops-1")
    cut = text.index(single) + 1
    assert seq_a[row_a["prompt_len"] :] == text[:cut]  # the engine stopped on the stop token
    assert by_token.choices[0].message.content == tok.decode(text[: cut - 1])
    shortest = next(k for k in range(1, len(text)) if multi in tok.decode(text[:k]))
    assert seq_b[row_b["prompt_len"] :] == text[:shortest]  # sampled further, recorded up to the stop
    full = tok.decode(text[:shortest])
    assert by_text.choices[0].message.content == full[: full.index(multi)]
    assert by_text.choices[0].finish_reason == row_b["finish_reason"] == "stop"


def test_admin_stats_and_execution_registration_is_retry_safe(stack):
    first = stack.register("admin-1", step=3)
    again = stack.register("admin-1", step=3)
    assert again["api_key"] == first["api_key"] and again["created"] is False and first["step"] == 3
    stats = stack.admin("GET", "/admin/stats").json()
    assert {e["engine_id"] for e in stats["engines"]} == {"A", "B"}
    assert stats["gateway_overhead_ms"]["samples"] > 0 and stats["calls"] > 0
    stack.finish("admin-1")
    refused = stack.admin("POST", "/admin/executions", json={"execution_id": "admin-1"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "execution_finished"
    assert httpx.get(f"{stack.url}/admin/stats", headers=ADMIN).status_code == 200


def test_a_finished_id_is_finished_within_its_campaign(stack):
    """Campaigns run one after another on one stack reuse their steps' ids; one id live in two
    campaigns at once is refused (its calls are addressed by id)."""
    register = {"execution_id": "s0-p-g0", "campaign": "first"}
    assert stack.admin("POST", "/admin/executions", json=register).status_code == 200
    live = stack.admin("POST", "/admin/executions", json={**register, "campaign": "second"})
    assert live.status_code == 409 and live.json()["error"]["code"] == "execution_id_taken"
    assert "first" in live.json()["error"]["message"]
    done = stack.admin(
        "POST", "/admin/executions/s0-p-g0/finish", json={"status": "completed", "reward": 0.0}
    )
    assert done.status_code == 200
    again = stack.admin("POST", "/admin/executions", json=register)
    assert again.status_code == 409 and again.json()["error"]["code"] == "execution_finished"
    second = stack.admin("POST", "/admin/executions", json={**register, "campaign": "second"})
    assert second.status_code == 200 and second.json()["campaign"] == "second"
    stack.admin("POST", "/admin/executions/s0-p-g0/finish", json={"status": "completed", "reward": 0.0})


def test_the_recorded_policy_version_is_the_engines_after_a_weight_swap(stack):
    engines = list(stack.engines.values())
    try:
        for engine in engines:  # the same weights under a new version number (a hot-swap)
            engine.update_weights(engine.runner.model.state_dict(), version=7)
        client = stack.client(stack.register("version-1"))
        out = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "v?"}], max_tokens=3
        )
        assert out.model_extra["gyre"]["policy_version"] == 7
        stack.finish("version-1")
        ((row, _),) = stack.calls("version-1")
        assert row["policy_version"] == 7
    finally:
        for engine in engines:
            engine.update_weights(engine.runner.model.state_dict(), version=0)
