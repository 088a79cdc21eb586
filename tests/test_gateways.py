"""Several gateways: each execution pinned to one by its id, standing by on the next; a gateway killed
mid-step loses no execution and no recorded call, and no call is recorded twice (real gateway
processes, one SIGKILLed and started again by hand as the supervisor would; a scripted engine; the
built-in harness through its relay; the store read back)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections import Counter

import httpx
import pytest

from engines.model.tokenizer import save_tokenizer
from engines.net import free_port
from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.gateway_admin import GatewayAdmin, GatewayAdminError
from environments.gateways import STANDBY_CALL_BASE, GatewayPool, gateway_order
from environments.relay import LoopbackRelay, Upstreams
from stack.stack import serving_process
from tests.scripted_engine import scripted_engine_app, tool_call
from tests.test_gateway_fixtures import ADMIN, ADMIN_TOKEN, scripted_gateway_config, serving, tokenizer
from tests.test_harness import turns, two_file_problem
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig

WRITES = 4  # tool turns before the last two: enough calls that a kill lands mid-execution


def policy(text: str) -> str:
    done = turns(text)
    if done < WRITES:
        return tool_call("write_file", path="a.txt", content="alpha\n")
    if done == WRITES:
        return tool_call("write_file", path="b.txt", content="beta\n")
    return tool_call("finish", summary="done")


def test_each_execution_has_an_order_over_the_gateways_that_moves_little():
    urls = [f"http://10.0.0.{n}:8000" for n in range(1, 4)]
    ids = [f"s0-p{n}-g0" for n in range(300)]
    first = Counter(gateway_order(urls, i)[0] for i in ids)
    assert set(first) == set(urls) and min(first.values()) > 60  # spread over all three
    assert all(gateway_order(urls, i) == gateway_order(list(reversed(urls)), i) for i in ids)
    # a gateway removed: only the executions it held move, each to its next
    fewer = urls[:2]
    for i in ids:
        order = gateway_order(urls, i)
        if order[0] != urls[2]:
            assert gateway_order(fewer, i)[0] == order[0]
        else:
            assert gateway_order(fewer, i)[0] == order[1]


def test_a_relay_moves_to_the_next_gateway_once_one_refuses_and_stays_there():
    async def run() -> list[bytes]:
        async def answer(name: bytes, reader, writer):
            await reader.read(1)
            writer.write(name)
            await writer.drain()
            writer.close()

        second = await asyncio.start_server(lambda r, w: answer(b"second", r, w), "127.0.0.1", 0)
        third = await asyncio.start_server(lambda r, w: answer(b"third", r, w), "127.0.0.1", 0)
        dead = free_port()  # nothing listens here: a gateway whose process died
        ports = [dead, second.sockets[0].getsockname()[1], third.sockets[0].getsockname()[1]]
        upstreams = Upstreams([("127.0.0.1", p) for p in ports])
        relay = await LoopbackRelay.start(upstreams)
        assert relay.url("http://10.0.0.1:8000/x/e1/v1") == f"http://127.0.0.1:{relay.port}/x/e1/v1"
        answers = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(b"?")
            await writer.drain()
            answers.append(await reader.read())
            writer.close()
        assert upstreams.current == 1  # the second took it: never back to the first, never past it
        await relay.close()
        second.close()
        third.close()
        return answers

    assert asyncio.run(run()) == [b"second", b"second"]


def test_a_standby_registration_shares_the_key_and_numbers_its_calls_apart(tmp_path):
    folder = str(tmp_path / "tokenizer")
    save_tokenizer(tokenizer(), folder)
    store = StoreConfig(data_root=str(tmp_path / "store"), campaign="pool")
    command = [sys.executable, "-m", "engines.gateway", "--config", "-"]
    with serving(scripted_engine_app(lambda text: "ok")) as (engine_url, _):
        configs = [
            scripted_gateway_config(folder, store, engine_url, str(tmp_path / f"spool{n}")) for n in range(2)
        ]
        env = dict(os.environ)
        with (
            serving_process(command, configs[0].base_url(), env, stdin=configs[0].model_dump_json()),
            serving_process(command, configs[1].base_url(), env, stdin=configs[1].model_dump_json()),
        ):

            async def run() -> tuple[dict, dict, dict]:
                async with httpx.AsyncClient() as client:
                    pool = GatewayPool([c.base_url() for c in configs], ADMIN_TOKEN, client)
                    registration = await pool.register("e1", step=0)
                    primary, standby = pool.placed["e1"]
                    # the harness's calls: one at the primary, then two at the standby (same key)
                    for url, n in ((registration["base_urls"][0], 1), (registration["base_urls"][1], 2)):
                        for _ in range(n):
                            answer = await client.post(
                                f"{url}/chat/completions",
                                json={"model": "m", "messages": [{"role": "user", "content": f"hi {n}"}]},
                                headers={"Authorization": f"Bearer {registration['api_key']}"},
                            )
                            assert answer.status_code == 200, answer.text
                    finished = await pool.finish("e1", "completed", reward=1.0, reward_source="final")
                    released = await client.get(f"{standby.url}/admin/executions/e1", headers=ADMIN)
                    finished_there = await client.get(f"{primary.url}/admin/executions/e1", headers=ADMIN)
                    return finished, released.json(), finished_there.json()

            finished, released, finished_there = asyncio.run(run())
    assert finished["calls"] == 3
    assert released["error"]["code"] == "execution_not_found" and "released" in released["error"]["message"]
    assert "completed" in finished_there["error"]["message"]
    calls = Store(store).read_table("calls").to_pylist()
    assert sorted(c["call_id"] for c in calls) == [0, STANDBY_CALL_BASE, STANDBY_CALL_BASE + 1]
    [row] = Store(store).read_table("executions").to_pylist()
    assert row["n_calls"] == 3 and row["status"] == "completed"


@pytest.mark.slow
def test_a_gateway_killed_mid_step_loses_no_execution_and_no_call(tmp_path):
    folder = str(tmp_path / "tokenizer")
    save_tokenizer(tokenizer(), folder)
    store = StoreConfig(data_root=str(tmp_path / "store"), campaign="gateways")
    command = [sys.executable, "-m", "engines.gateway", "--config", "-"]
    env = dict(os.environ)
    problems = [two_file_problem(f"p{n}") for n in range(3)]
    config = DispatchConfig(
        workspace_root=str(tmp_path / "ws"),
        group_size=2,
        concurrency=6,
        durations=DurationProfile(short_turns=WRITES + 4, long_fraction=0.0),
    )
    with serving(scripted_engine_app(policy, delay_s=0.25)) as (engine_url, _):
        configs = [
            scripted_gateway_config(folder, store, engine_url, str(tmp_path / f"spool{n}")) for n in range(2)
        ]
        urls = [c.base_url() for c in configs]
        killed: dict[str, float] = {}
        with contextlib.ExitStack() as stack:
            processes = [
                stack.enter_context(serving_process(command, u, env, stdin=c.model_dump_json()))
                for u, c in zip(urls, configs, strict=True)
            ]

            def kill_one_mid_step() -> None:
                """SIGKILLs the first gateway to have answered 4 calls (its executions are mid-way)."""
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    for n, url in enumerate(urls):
                        stats = httpx.get(f"{url}/admin/stats", headers=ADMIN, timeout=5).json()
                        if stats["calls"] >= 4:
                            processes[n].kill()
                            processes[n].wait()
                            killed.update(index=n, calls=stats["calls"])
                            return
                    time.sleep(0.05)

            killer = threading.Thread(target=kill_one_mid_step)
            killer.start()
            outcomes = asyncio.run(dispatch(problems, urls, ADMIN_TOKEN, store, config))
            killer.join()
            assert killed, "no gateway answered 4 calls within a minute"
            dead = killed["index"]
            # the supervisor's restart: the new process writes the dead one's spool before it serves
            with serving_process(command, urls[dead], env, stdin=configs[dead].model_dump_json()):
                pass

    assert len(outcomes) == 6
    assert [o.status for o in outcomes] == ["completed"] * 6, [o.error for o in outcomes]
    assert all(o.reward == 1.0 for o in outcomes)
    moved = {o.execution_id for o in outcomes if gateway_order(urls, o.execution_id)[0] == urls[dead]}
    assert moved, "the killed gateway was no execution's primary"
    con = connect(Store(store))
    calls = con.sql(
        "SELECT execution_id, call_id, context_hash, prompt_len FROM calls ORDER BY execution_id, call_id"
    ).fetchall()
    executions = con.sql("SELECT execution_id, status, n_calls FROM executions").fetchall()
    assert sorted(e[0] for e in executions) == sorted(o.execution_id for o in outcomes)  # one row each
    assert len({(c[0], c[1]) for c in calls}) == len(calls)  # no call recorded twice under one id
    by_execution: dict[str, list[tuple]] = {}
    for c in calls:
        by_execution.setdefault(c[0], []).append(c)
    for execution_id, rows in by_execution.items():
        # every turn the harness took is recorded: one distinct context per turn, growing turn by turn
        # (a lost call breaks the count, a call recorded out of turn the order)
        contexts = [r[2] for r in rows]
        assert len(set(contexts)) == WRITES + 2, (execution_id, rows)
        assert [r[3] for r in rows] == sorted(r[3] for r in rows)
        # a context twice only where the killed gateway spooled a call whose answer never left it and
        # the harness asked again at the standby: a dead-end branch, one at most, across the two gateways
        twice = [c for c in set(contexts) if contexts.count(c) > 1]
        assert not twice or (execution_id in moved and len(rows) == WRITES + 3), (execution_id, rows)
        for context in twice:
            ids = sorted(r[1] for r in rows if r[2] == context)
            assert ids[0] < STANDBY_CALL_BASE <= ids[1], (execution_id, rows)
        at_standby = [r[1] for r in rows if r[1] >= STANDBY_CALL_BASE]
        assert execution_id in moved or not at_standby
        if at_standby:  # the standby numbered its calls after the primary's, from its own base
            assert at_standby == list(range(STANDBY_CALL_BASE, STANDBY_CALL_BASE + len(at_standby)))
    assert any(r[1] >= STANDBY_CALL_BASE for r in calls), "no execution went on at its standby"
    assert sum(e[2] for e in executions) <= len(calls)  # the standby's n_calls cannot count the dead one's
    # the trees rebuild over both gateways' calls: one trajectory per execution's last call
    [(trees,)] = con.sql("SELECT count(DISTINCT execution_id) FROM trajectories").fetchall()
    assert trees == 6


def test_the_admin_client_spells_release(tmp_path):
    """GatewayAdmin.release reaches the gateway's route, and a key is one live execution's (a real
    gateway in-process)."""
    from tests.scripted_engine import scripted_stack

    with scripted_stack(str(tmp_path), lambda text: "ok") as stack:

        async def run() -> tuple[dict, GatewayAdminError]:
            async with httpx.AsyncClient() as client:
                admin = GatewayAdmin(stack.url, ADMIN_TOKEN, client)
                key = "k" * 40
                await admin.register("e1", step=0, api_key=key, first_call_id=7)
                with pytest.raises(GatewayAdminError) as taken:  # one live execution per key
                    await admin.register("e2", step=0, api_key=key, first_call_id=7)
                return await admin.release("e1"), taken.value

        released, taken = asyncio.run(run())
    assert taken.status == 409 and taken.code == "api_key_taken"
    assert released["execution_id"] == "e1" and released["calls"] == 0
    assert Store(stack.store_config).read_table("executions").num_rows == 0  # no row: another records it
