"""The gateway under hostile input (issue 11, section 4), end to end over real HTTP: a huge message is
refused by its size before it is tokenized, a large one is tokenized off the event loop while /health and
other calls are served, an execution past its call / agent / token caps is refused, a finish with a reward
outside [0, 1] (or not finite) is refused with 422, and valid traffic around all of these keeps working."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.test_gateway_fixtures import gateway_stack, one_cpu_thread, scripted_model, tokenizer

LIMITS = {
    "max_prompt_tokens": 2000,
    "max_prompt_chars": 6_000_000,
    "max_request_bytes": 16 * 2**20,
    "max_calls_per_execution": 3,
    "max_agents_per_execution": 2,
    "max_execution_tokens": 3000,
}


@pytest.fixture(scope="module")
def model():
    return scripted_model(tokenizer())


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model):
    with (
        one_cpu_thread(),
        gateway_stack(str(tmp_path_factory.mktemp("gw")), model, engine_ids=("A",), limits=LIMITS) as s,
    ):
        yield s


def ask(client, content: str = "Hello.", **kwargs):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=2, **kwargs
    )


def words(n_chars: int, seed: int = 0) -> str:
    """Text of about n_chars characters from 500 distinct vocabulary pieces."""
    tok = tokenizer()
    rng = random.Random(seed)
    pieces = [tok.decode([i]).strip() or "x" for i in rng.sample(range(300, 4000), 500)]
    out, size = [], 0
    while size < n_chars:
        piece = rng.choice(pieces)
        out.append(piece)
        size += len(piece) + 1
    return " ".join(out)


def test_a_10_mb_message_is_refused_by_its_size_before_tokenization(stack):
    client = stack.client(stack.register("huge"))
    before = stack.gateway.stats.tokenized_prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, "y" * 10_000_000)
    error = refused.value
    assert error.body["code"] == "context_length_exceeded" and error.body["param"] == "messages"
    assert "10000000 characters" in error.message and "6000000" in error.message
    assert "max_prompt_chars" in error.message and "before tokenization" in error.message
    assert stack.gateway.stats.tokenized_prompt_tokens == before  # nothing was tokenized
    assert "huge/main" not in stack.gateway.router.sessions  # no session was opened for it
    # a text prompt on /v1/completions is measured the same way
    with pytest.raises(openai.BadRequestError) as text_prompt:
        client.completions.create(model="m", prompt="z" * 7_000_000, max_tokens=2)
    assert text_prompt.value.body["param"] == "prompt" and "7000000 characters" in text_prompt.value.message
    # the execution goes on
    assert ask(client).choices[0].finish_reason == "length"
    stack.finish("huge")
    assert len(stack.calls("huge")) == 1  # only the valid call was recorded


def test_health_is_served_while_a_large_prompt_is_tokenized(tmp_path, model):
    limits = {**LIMITS, "max_execution_tokens": 10**8}
    with one_cpu_thread(), gateway_stack(str(tmp_path), model, engine_ids=("A",), limits=limits) as stack:
        registration = stack.register("large")
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": words(5_000_000)}]}
        headers = {"Authorization": f"Bearer {registration['api_key']}"}
        url = registration["base_url"] + "/chat/completions"
        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(httpx.post, url, json=body, headers=headers, timeout=300)
            deadline = time.monotonic() + 120
            while not any(t.name.startswith("gyre-tokenizer") for t in threading.enumerate()):
                assert time.monotonic() < deadline and not big.done(), (
                    "the large prompt never reached a tokenizer thread"
                )
                time.sleep(0.002)
            # the prompt is being tokenized now: the event loop must still answer, several times over
            health = [httpx.get(f"{stack.url}/health", timeout=120).status_code for _ in range(3)]
            answered_first = not big.done()
            response = big.result(timeout=300)
        assert health == [200, 200, 200]
        assert answered_first, "/health was answered only after the large request finished"
        # allowed by its size, it was tokenized, then refused by its token count
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "context_length_exceeded"
        assert "tokens, above this gateway's limit of 2000" in error["message"]
        client = stack.client(registration)
        assert ask(client).choices[0].finish_reason == "length"


def test_an_execution_past_its_call_cap_is_refused_and_others_go_on(stack):
    client = stack.client(stack.register("calls"))
    for turn in range(3):
        ask(client, f"Turn {turn}.")
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, "One more.")
    assert refused.value.body["code"] == "execution_limit_exceeded"
    assert (
        "has made 3 calls" in refused.value.message and "max_calls_per_execution = 3" in refused.value.message
    )
    other = stack.client(stack.register("calls-other"))
    assert ask(other).choices[0].finish_reason == "length"
    assert stack.finish("calls")["calls"] == 3
    stack.finish("calls-other")
    assert len(stack.calls("calls")) == 3


def test_an_execution_past_its_agent_cap_is_refused(stack):
    registration = stack.register("agents")
    ask(stack.client(registration))
    ask(stack.client(registration, agent="helper"), extra_headers={"X-Gyre-Role": "sub"})
    with pytest.raises(openai.BadRequestError) as refused:
        ask(stack.client(registration, agent="third"), extra_headers={"X-Gyre-Role": "sub"})
    assert refused.value.body["code"] == "execution_limit_exceeded"
    assert "already has 2 agents" in refused.value.message and "'third'" in refused.value.message
    assert ask(stack.client(registration, agent="helper")).choices[0].finish_reason == "length"
    stack.finish("agents")


def test_an_execution_past_its_token_cap_is_refused(stack):
    client = stack.client(stack.register("tokens"))
    first = ask(client, words(5000, seed=1))
    taken = first.usage.prompt_tokens + first.usage.completion_tokens
    assert 1000 < taken < 3000, taken  # the scripted tokenizer: the cap of 3000 leaves room for one such call
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, words(5000, seed=2))
    message = refused.value.message
    assert refused.value.body["code"] == "execution_limit_exceeded"
    assert f"has taken {taken} tokens" in message and "max_execution_tokens = 3000" in message
    # a small call still fits, and the refused one was never recorded
    assert ask(client, "Short.").choices[0].finish_reason == "length"
    stack.finish("tokens")
    assert len(stack.calls("tokens")) == 2


@pytest.mark.parametrize("reward", [b"7", b"-1", b"NaN", b"Infinity", b"1.0000001"])
def test_a_reward_outside_0_1_or_not_finite_is_refused(stack, reward):
    name = f"reward-{reward.decode().lower().replace('.', '-')}"
    client = stack.client(stack.register(name))
    ask(client)
    path = f"/admin/executions/{name}/finish"
    body = b'{"status": "completed", "reward": ' + reward + b"}"
    refused = stack.admin("POST", path, content=body)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["param"] == "reward" and error["code"] == "invalid_reward"
    assert "not a finite number in [0, 1]" in error["message"]
    # the execution is still live: it takes calls, and a valid finish stores its reward
    ask(client)
    assert stack.finish(name, reward=0.5)["calls"] == 2
    from trajectory_store.storage import Store

    rows = Store(stack.store_config).read_table("executions").to_pylist()
    assert [r["reward"] for r in rows if r["execution_id"] == name] == [0.5]


def test_rewards_at_the_ends_of_the_range_and_none_are_accepted(stack):
    for name, body in [
        ("reward-zero", {"status": "completed", "reward": 0}),
        ("reward-one", {"status": "completed", "reward": 1}),
        ("reward-none", {"status": "eval_failed"}),
    ]:
        stack.register(name)
        finished = stack.admin("POST", f"/admin/executions/{name}/finish", json=body)
        assert finished.status_code == 200, finished.text
