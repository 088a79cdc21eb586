"""Routing under change: draining an engine (KV and a request in flight move, the harness sees nothing)
and engine death (the call re-runs elsewhere from its exact recorded prompt; recomputed tokens counted)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engines.model.tokenizer import save_tokenizer
from engines.net import free_port
from tests.test_gateway_fixtures import (
    ENGINE_TOKEN,
    TEXT_SCRIPT_TOKENS,
    gateway_stack,
    kill,
    scripted_model,
    scripts,
    tokenizer,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return scripted_model(tokenizer())


def chat(client, messages, **kwargs):
    out = client.chat.completions.create(model="gyre-policy", messages=messages, **kwargs)
    messages += [out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    return out


def slow_down(engine, seconds: float) -> None:
    """Makes every engine step take a while (a loaded engine), so a request is surely mid-decode when
    the test acts; the engine lock is free during the pause."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    engine.step = slow_step


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def long_call_finishes_on_b(stack, client, engine: str, lose: Callable[[], object], timeout: float) -> None:
    """A 2000-token call decoding on ``engine`` loses it (``lose()``) while engine B is activated: the
    gateway finishes it on B, whole, marked rerouted."""
    router = stack.gateway.router
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.completions.create, model="m", prompt=[5, 6, 7, 8], max_tokens=2000, seed=1)
        wait_until(lambda: router.engines[engine].in_flight == 1)
        time.sleep(0.3)  # well inside the 2000-token decode (400 tokens finished first under load once)
        lose()
        router.activate("B")
        out = call.result(timeout=timeout)
    assert out.choices[0].finish_reason == "length" and len(out.choices[0].model_extra["token_ids"]) == 2000
    gyre = out.model_extra["gyre"]
    assert gyre["engine_id"] == "B" and gyre["rerouted"] is True


def test_drain_moves_idle_and_in_flight_sessions_with_their_kv(tmp_path, model):
    text = scripts(tokenizer())[1]
    with gateway_stack(str(tmp_path), model, attach=("A",)) as stack, ThreadPoolExecutor(2) as pool:
        busy, idle = stack.client(stack.register("busy")), stack.client(stack.register("idle"))
        busy_messages = [{"role": "user", "content": "Write a lot."}]
        idle_messages = [{"role": "user", "content": "Wait."}]
        chat(busy, busy_messages)
        chat(idle, idle_messages)
        with stack.typed_admin() as admin:
            added = admin.add_engine(stack.engine_urls["B"])
        assert added.engine_id == "B"  # the engine's own id, read from its /admin/stats
        engine_a = stack.engines["A"]
        slow_down(engine_a, 0.02)
        call = pool.submit(chat, busy, busy_messages)
        wait_until(lambda: engine_a.running and len(engine_a.running[0].output_ids) >= 5)
        with stack.typed_admin() as admin:
            report = admin.drain("A")
        reply = call.result(timeout=60)  # a normal answer: the harness never saw the move

        assert report.sessions == 2 and report.moved_with_kv == 2 and report.moved_mid_request == 1
        assert report.failed == [] and report.state == "draining"
        assert (
            reply.choices[0].finish_reason == "stop"
            and reply.usage.completion_tokens == TEXT_SCRIPT_TOKENS + 1
        )
        assert reply.model_extra["gyre"]["migrated"] is True and reply.model_extra["gyre"]["engine_id"] == "B"
        b_stats = stack.engine_stats("B")
        assert b_stats["migrations_in"] == 2 and b_stats["prefilled_tokens"] == 0  # no context recomputed

        chat(busy, busy_messages, max_tokens=4)  # both sessions continue on B from the migrated KV
        chat(idle, idle_messages, max_tokens=4)
        fresh = stack.client(stack.register("fresh"))
        chat(fresh, [{"role": "user", "content": "New."}], max_tokens=2)  # A takes no new session
        stack.finish("busy")
        stack.finish("idle")
        stack.finish("fresh")
        busy_calls, idle_calls = stack.calls("busy"), stack.calls("idle")
        assert [row["engine_id"] for row, _ in busy_calls] == ["A", "B", "B"]
        assert [row["migrated"] for row, _ in busy_calls] == [False, True, False]
        assert busy_calls[1][1][busy_calls[1][0]["prompt_len"] :] == text  # the same output as unmigrated
        assert [row["engine_id"] for row, _ in idle_calls] == ["A", "B"]
        assert stack.calls("fresh")[0][0]["engine_id"] == "B"
        # B prefilled only what each session's next prompt added after the migrated context
        new_tokens = 0
        for calls in (busy_calls, idle_calls):
            (_, before), (row, _after) = calls[-2], calls[-1]
            new_tokens += row["prompt_len"] - (len(before) - 1)  # the last sampled token was never fed
        fresh_prompt = stack.calls("fresh")[0][0]["prompt_len"]
        assert stack.engine_stats("B")["prefilled_tokens"] == new_tokens + fresh_prompt
        with stack.typed_admin() as admin:
            stats = admin.gateway_stats()
        assert stats.sessions_migrated == 2 and stats.requests_migrated == 1 and stats.migrated_calls == 1


def test_a_dead_engine_calls_re_run_from_the_exact_prompt_elsewhere(tmp_path, model):
    with gateway_stack(str(tmp_path), model) as stack:
        victim = stack.client(stack.register("victim"))
        messages = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "Start."}]
        first = chat(victim, messages, max_tokens=6)
        assert first.model_extra["gyre"]["engine_id"] == "A"
        kill(stack.engine_servers["A"])
        wait_until(lambda: _refuses(stack.engine_urls["A"]))

        second = chat(victim, messages, max_tokens=6)  # the harness sees a normal answer
        gyre = second.model_extra["gyre"]
        assert gyre["engine_id"] == "B" and gyre["rerouted"] is True
        assert gyre["recomputed_tokens"] == gyre["reused_prompt_tokens"] > 0
        third = chat(victim, messages, max_tokens=6)
        assert (
            third.model_extra["gyre"]["rerouted"] is False and third.model_extra["gyre"]["engine_id"] == "B"
        )
        stack.finish("victim")

        calls = stack.calls("victim")
        assert [row["engine_id"] for row, _ in calls] == ["A", "B", "B"]
        (_, first_seq), (row, second_seq) = calls[0], calls[1]
        assert second_seq[: len(first_seq)] == first_seq  # the recorded context, token for token
        with stack.typed_admin() as admin:
            stats = admin.gateway_stats()
        assert stats.engine_deaths == 1 and stats.rerouted_calls == 1
        assert stats.recomputed_tokens == gyre["recomputed_tokens"]
        assert {e.engine_id: e.state for e in stats.engines} == {"A": "dead", "B": "active"}
        assert stack.engine_stats("B")["prefilled_tokens"] >= row["prompt_len"]


def test_an_engine_killed_mid_request_loses_nothing(tmp_path, model):
    folder = tmp_path / "scripted"
    model.save_pretrained(folder)
    save_tokenizer(tokenizer(), folder)
    port = free_port()
    command = [sys.executable, "-m", "engines.rollout.server", "--model", str(folder), "--port", str(port)]
    command += ["--engine-id", "Z", "--admin-token", ENGINE_TOKEN]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: process.poll() is None and _answers(url), timeout=120)
        with gateway_stack(
            str(tmp_path / "gw"), model, engine_ids=("B",), extra_engines=[("Z", url)]
        ) as stack:
            stack.gateway.router.engines["B"].state = "draining"  # new sessions go to Z
            client = stack.client(stack.register("crash"))
            long_call_finishes_on_b(
                stack, client, "Z", lose=lambda: process.send_signal(signal.SIGKILL), timeout=120
            )
            stack.finish("crash")
            ((row, sequence),) = stack.calls("crash")
            assert sequence[:4] == [5, 6, 7, 8] and row["engine_id"] == "B" and row["output_len"] == 2000
            assert stack.admin("GET", "/admin/stats").json()["engine_deaths"] == 1
    finally:
        process.kill()
        process.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _refuses(url: str) -> bool:
    return not _answers(url)
