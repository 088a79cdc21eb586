"""A dispatcher that dies leaves live executions at the gateway with calls already recorded: the next
attempt of the same group member takes a new id, the dead attempt is recorded as abandoned, and no
reward is ever joined to another attempt's calls (a real gateway, a scripted engine, the store)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.gateway_admin import GatewayAdmin, GatewayAdminError
from environments.ledger import step_ledger
from environments.sweep import (
    HARNESS_FILE,
    OWNER_FILE,
    forget_harness,
    record_harness,
    start_time,
    sweep_dead_dispatchers,
)
from tests.scripted_engine import scripted_stack, tool_call
from tests.test_gateway_fixtures import ADMIN_TOKEN
from tests.test_harness import turns, two_file_problem
from trajectory_store.db import connect
from trajectory_store.step import step_figures
from trajectory_store.storage import Store


def policy(text: str) -> str:
    if turns(text) == 0:
        return tool_call("write_file", path="a.txt", content="alpha\n")
    return tool_call("finish", summary="half")


def dead_dispatcher(stack, execution_id: str, problem_id: str, group_id: str, calls: int) -> None:
    """Registers an execution as a dispatcher would, makes ``calls`` calls, flushes them to the store
    and never finishes it (the dispatcher died)."""

    async def run() -> None:
        async with httpx.AsyncClient() as client:
            admin = GatewayAdmin(stack.url, ADMIN_TOKEN, client)
            registration = await admin.register(
                execution_id, problem_id=problem_id, group_id=group_id, step=0, attempt="dead-dispatcher"
            )
            again = await admin.register(
                execution_id, problem_id=problem_id, group_id=group_id, step=0, attempt="dead-dispatcher"
            )
            assert (
                again["created"] is False and again["api_key"] == registration["api_key"]
            )  # a retried request
            model = openai.AsyncOpenAI(base_url=registration["base_url"], api_key=registration["api_key"])
            messages = [{"role": "user", "content": "start"}]
            for _ in range(calls):
                reply = await model.chat.completions.create(model="any", messages=messages, max_tokens=32)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
                messages += [{"role": "user", "content": "go on"}]
            await admin._request("POST", "/admin/flush")

    asyncio.run(run())


def run_step(stack, problem, tmp_path, ledger=None):
    config = DispatchConfig(
        workspace_root=str(tmp_path / "ws"),
        group_size=1,
        durations=DurationProfile(short_turns=5, long_fraction=0.0),
    )
    return asyncio.run(dispatch([problem], stack.url, ADMIN_TOKEN, stack.store_config, config, ledger=ledger))


def test_a_new_attempt_abandons_the_dead_one_and_never_inherits_its_calls(tmp_path):
    problem = two_file_problem("good")
    with scripted_stack(str(tmp_path), policy) as stack:
        dead_dispatcher(stack, "s0-good-g0", "good", "s0-good", calls=3)
        ledger = step_ledger(stack.store_config, 0)
        assert "s0-good-g0" in ledger.used and ledger.outcome(problem, 0) is None  # calls, no ending
        [outcome] = run_step(stack, problem, tmp_path)
        store = Store(stack.store_config)
        rows = {r["execution_id"]: r for r in store.read_table("executions").to_pylist()}
        calls = store.read_table("calls").to_pylist()
        ledger = step_ledger(stack.store_config, 0)
        con = connect(store)
        selected = {
            r[0] for r in con.execute("SELECT DISTINCT execution_id FROM selected_trajectories").fetchall()
        }
        figures = step_figures(con, 0)
    assert outcome.execution_id == "s0-good-g0-a1" and outcome.status == "completed" and outcome.reward == 0.5
    dead = rows["s0-good-g0"]
    assert dead["status"] == "abandoned" and dead["reward"] is None and dead["group_id"] == "s0-good"
    assert rows["s0-good-g0-a1"]["reward"] == 0.5
    by_execution = {}
    for call in calls:
        by_execution[call["execution_id"]] = by_execution.get(call["execution_id"], 0) + 1
    assert by_execution["s0-good-g0"] == 3  # the dead attempt's calls, kept under its own id
    assert by_execution["s0-good-g0-a1"] == outcome.calls >= 2
    assert selected == {"s0-good-g0-a1"}  # the abandoned attempt is never trained on
    assert figures["executions"] == 1 and figures["executions_abandoned"] == 1 and figures["pass_rate"] == 0
    assert ledger.outcome(problem, 0).execution_id == "s0-good-g0-a1"  # the member is done: a retried
    # step dispatches nothing more for it


def test_an_attempt_that_ended_at_the_gateway_after_the_ledger_was_read_is_never_run_again(tmp_path):
    """A dispatcher killed right after the gateway took its attempt's ending: the next dispatcher read
    the store before that row landed. The gateway says the attempt is finished, so the member has its
    ending and no second attempt runs (that would be a sample trained twice: CI saw it once)."""
    problem = two_file_problem("good")
    with scripted_stack(str(tmp_path), policy) as stack:
        dead_dispatcher(stack, "s0-good-g0", "good", "s0-good", calls=2)
        stale = step_ledger(stack.store_config, 0)  # read before the ending lands

        async def finish() -> None:
            async with httpx.AsyncClient() as client:
                await GatewayAdmin(stack.url, ADMIN_TOKEN, client).finish(
                    "s0-good-g0", "completed", reward=1.0
                )

        asyncio.run(finish())
        assert stale.outcome(problem, 0) is None and "s0-good-g0" in stale.used
        outcomes = run_step(stack, problem, tmp_path, ledger=stale)
        rows = {
            r["execution_id"]: r["status"]
            for r in Store(stack.store_config).read_table("executions").to_pylist()
        }
    assert outcomes == [] and rows == {"s0-good-g0": "completed"}


def test_calls_left_by_a_gateway_that_died_push_the_next_attempt_to_a_new_id(tmp_path):
    """The gateway died with the execution live: its calls are in the store, the gateway that comes
    back has never heard of it, so only the store can tell that the id is taken."""
    problem = two_file_problem("good")
    with scripted_stack(str(tmp_path), policy) as stack:
        dead_dispatcher(stack, "s0-good-g0", "good", "s0-good", calls=2)
    with scripted_stack(str(tmp_path), policy) as stack:
        [outcome] = run_step(stack, problem, tmp_path)
        calls = Store(stack.store_config).read_table("calls").column("execution_id").to_pylist()
        rows = {
            r["execution_id"]: r["status"]
            for r in Store(stack.store_config).read_table("executions").to_pylist()
        }
    assert outcome.execution_id == "s0-good-g0-a1" and outcome.status == "completed"
    assert calls.count("s0-good-g0") == 2 and calls.count("s0-good-g0-a1") == outcome.calls
    assert rows == {"s0-good-g0": "abandoned", "s0-good-g0-a1": "completed"}  # every attempt has an ending


def test_two_live_dispatchers_never_both_finish_one_member(tmp_path):
    """The second dispatcher supersedes the first one's attempt; the first's finish is refused."""
    with scripted_stack(str(tmp_path), policy) as stack:

        async def run() -> None:
            async with httpx.AsyncClient() as client:
                admin = GatewayAdmin(stack.url, ADMIN_TOKEN, client)
                await admin.register(
                    "s0-good-g0", problem_id="good", group_id="s0-good", step=0, attempt="first"
                )
                with pytest.raises(GatewayAdminError) as refused:
                    await admin.register(
                        "s0-good-g0", problem_id="good", group_id="s0-good", step=0, attempt="second"
                    )
                assert refused.value.status == 409 and refused.value.code == "execution_superseded"
                with pytest.raises(GatewayAdminError) as late:
                    await admin.finish("s0-good-g0", "completed", reward=1.0, reward_source="final")
                assert late.value.status == 404

        asyncio.run(run())
        rows = Store(stack.store_config).read_table("executions").to_pylist()
    assert [(r["execution_id"], r["status"], r["reward"]) for r in rows] == [
        ("s0-good-g0", "abandoned", None)
    ]


def test_a_dead_dispatchers_folders_and_quota_mounts_are_swept(tmp_path):
    """A SIGKILLed dispatcher never releases its sandboxes' tmpfs mounts (they hold their files in
    memory) nor removes its temporary folders: the next dispatcher does, and only for dead owners."""
    from environments.sandbox import Sandbox, SandboxLimits, probe_isolation

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is free now: the owner is gone
    left = tmp_path / "gyre-workspaces-left"
    left.mkdir()
    (left / OWNER_FILE).write_text(str(dead.pid))
    sandbox = Sandbox.create(left, "ab12", {"a.txt": "x\n"}, SandboxLimits(disk_bytes=1 << 20, disk_files=64))
    assert sandbox.disk_quota_enforced or not probe_isolation().filesystem  # a real tmpfs where mounts work
    live = tmp_path / "gyre-harness-live"
    live.mkdir()
    (live / OWNER_FILE).write_text(str(os.getpid()))
    unowned = tmp_path / "gyre-workspaces-unowned"
    unowned.mkdir()
    assert sweep_dead_dispatchers(tmp_path) == 1
    assert not left.exists() and live.exists() and unowned.exists()
    with open("/proc/self/mounts") as mounts:
        assert str(sandbox.workspace) not in mounts.read()


def hanging_harness() -> tuple[subprocess.Popen, int]:
    """A harness that hangs, in its own process group as the dispatcher starts one, with a child in
    that group (what a harness starts that is not sandboxed); returns it and the child's pid."""
    harness = subprocess.Popen(
        ["bash", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, start_new_session=True
    )
    return harness, int(harness.stdout.readline())


def ended(pid: int, wait_s: float = 10.0) -> bool:
    """Gone, or a zombie (killed; reparented, it waits for whoever reaps orphans here)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def dead_pid() -> int:
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()  # its pid is free now: the owner is gone
    return dead.pid


def test_a_sigkilled_dispatchers_hanging_harnesses_are_killed_by_the_sweep(tmp_path):
    """A SIGKILLed dispatcher's harnesses run on (they have their own process groups): the next
    dispatcher's sweep kills each recorded group, also one whose leader already died, but never a
    process that took over a recorded pid."""
    left = tmp_path / "gyre-harness-x"
    left.mkdir()
    (left / OWNER_FILE).write_text(str(dead_pid()))
    harness, child = hanging_harness()
    record_harness(left, harness.pid)
    leaderless, its_child = hanging_harness()
    record_harness(left, leaderless.pid)
    os.kill(leaderless.pid, signal.SIGKILL)  # the leader is gone, its child still runs in its group
    leaderless.wait()
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    with open(left / HARNESS_FILE, "a") as records:  # as if a recorded harness's pid were reused
        records.write(f"{stranger.pid} {start_time(stranger.pid) - 1}\n")
    try:
        assert sweep_dead_dispatchers(tmp_path) == 1
        assert harness.wait(timeout=10) == -signal.SIGKILL
        assert ended(child) and ended(its_child)
        assert stranger.poll() is None
        assert not left.exists()
    finally:
        for process in (harness, leaderless, stranger):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            if process.stdout:
                process.stdout.close()


def test_a_live_dispatchers_harnesses_are_never_killed(tmp_path):
    live = tmp_path / "gyre-harness-live"
    live.mkdir()
    (live / OWNER_FILE).write_text(str(os.getpid()))
    harness, child = hanging_harness()
    record_harness(live, harness.pid)
    try:
        assert sweep_dead_dispatchers(tmp_path) == 0
        time.sleep(0.2)
        assert harness.poll() is None and not ended(child, wait_s=0) and live.exists()
        forget_harness(live, harness.pid)  # what the dispatcher does once it has waited for one
        assert (live / HARNESS_FILE).read_text() == ""
    finally:
        os.killpg(harness.pid, signal.SIGKILL)
        harness.wait()
        harness.stdout.close()
