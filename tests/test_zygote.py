"""The harness zygote (environments/zygote.py): a forked child is the process a plain subprocess was
(its own session and group, exactly the given environment and argv, its log, its exit code), a
deadline's group kill reaches it, and a zygote that dies fails its waits and is started again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import textwrap

import pytest

from environments.zygote import Zygote, ZygoteLost

TARGET = textwrap.dedent(
    """
    import json, os, sys, time

    def main(argv):
        if argv[0] == "sleep":
            print("sleeping", flush=True)
            time.sleep(float(argv[1]))
            return 0
        if argv[0] == "raise":
            raise RuntimeError("the target failed")
        if argv[0] == "exit":
            raise SystemExit(int(argv[1]))
        print(json.dumps({
            "argv": argv, "env": dict(os.environ), "pid": os.getpid(), "sid": os.getsid(0),
            "pgid": os.getpgid(0), "stdin": sys.stdin.read(), "ppid": os.getppid(),
        }))
        return int(argv[1])
    """
)


@pytest.fixture
def zygote(tmp_path):
    (tmp_path / "zygote_target.py").write_text(TARGET)
    paths = os.pathsep.join([str(tmp_path), *[p for p in sys.path if p]])
    return Zygote(
        {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": paths}, "zygote_target:main"
    )


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_child_is_a_session_leader_with_exactly_its_environment_argv_and_log(zygote, tmp_path):
    async def go():
        try:
            env = {"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "k-1", "HOME": str(tmp_path)}
            pid = await zygote.spawn(["report", "7", "--flag"], env, str(tmp_path / "a.log"))
            code = await zygote.wait(pid)
            return pid, code, zygote.process.pid
        finally:
            await zygote.close()

    pid, code, zygote_pid = run(go())
    assert code == 7
    seen = json.loads((tmp_path / "a.log").read_text())
    assert seen["argv"] == ["report", "7", "--flag"]
    assert seen["env"] == {"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "k-1", "HOME": str(tmp_path)}
    assert seen["pid"] == pid == seen["sid"] == seen["pgid"]  # its own session and process group
    assert seen["ppid"] == zygote_pid and seen["stdin"] == ""


def test_exit_codes_and_failures_are_reported_as_a_subprocess_would(zygote, tmp_path):
    async def go():
        try:
            raised = await zygote.spawn(["raise"], {}, str(tmp_path / "raise.log"))
            exited = await zygote.spawn(["exit", "3"], {}, str(tmp_path / "exit.log"))
            many = [await zygote.spawn(["report", str(i)], {}, str(tmp_path / f"{i}.log")) for i in range(12)]
            codes = await asyncio.gather(*(zygote.wait(p) for p in many))
            return await zygote.wait(raised), await zygote.wait(exited), codes
        finally:
            await zygote.close()

    raised, exited, codes = run(go())
    assert raised == 1 and "RuntimeError: the target failed" in (tmp_path / "raise.log").read_text()
    assert exited == 3
    assert codes == list(range(12))


def test_a_deadline_kills_the_childs_group_and_its_exit_is_waited_again(zygote, tmp_path):
    async def go():
        try:
            pid = await zygote.spawn(["sleep", "60"], {}, str(tmp_path / "s.log"))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(zygote.wait(pid), 0.5)
            os.killpg(pid, signal.SIGKILL)
            return await asyncio.wait_for(zygote.wait(pid), 10)
        finally:
            await zygote.close()

    assert run(go()) == -signal.SIGKILL
    assert "sleeping" in (tmp_path / "s.log").read_text()


def test_a_dead_zygote_fails_its_waits_and_the_next_spawn_starts_another(zygote, tmp_path):
    async def go():
        orphan = None
        try:
            orphan = await zygote.spawn(["sleep", "60"], {}, str(tmp_path / "o.log"))
            first = zygote.process.pid
            zygote.process.kill()
            with pytest.raises(ZygoteLost):
                await asyncio.wait_for(zygote.wait(orphan), 10)
            pid = await zygote.spawn(["report", "0"], {}, str(tmp_path / "b.log"))
            return first, zygote.process.pid, await zygote.wait(pid)
        finally:
            if orphan is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(orphan, signal.SIGKILL)
            await zygote.close()

    first, second, code = run(go())
    assert first != second and code == 0


def test_the_zygote_ends_with_its_dispatcher_and_leaves_running_children_to_the_sweep(zygote, tmp_path):
    async def go():
        pid = await zygote.spawn(["sleep", "60"], {}, str(tmp_path / "s.log"))
        process = zygote.process
        await zygote.close()
        return pid, process.returncode

    pid, returncode = run(go())
    try:
        assert returncode == 0
        os.kill(pid, 0)  # still alive in its own session: the sweep of dead dispatchers kills it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
