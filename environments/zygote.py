"""A warm launcher for the built-in harness: one process that imports the harness once and forks a
process per execution.

    python -m environments.zygote [--target environments.harness:main]   # requests on stdin

Starting ``python -m environments.harness`` costs about 1.2 s of CPU here, most of it importing the
``openai`` client; a short execution of the demo costs about 3 CPU-seconds in all, so on a 2-core
machine two fifths of the rollout went into imports. The zygote pays for them once per dispatch: the
dispatcher sends it one request per execution and it forks a child that is already warm. A child is
what the plain subprocess was: the leader of a session and process group of its own (the deadline
kills the group), with exactly the environment, argv and log file the dispatcher gave, and stdin on
/dev/null; its exit code is reported as asyncio reports a subprocess's (negative: killed by that
signal).

Protocol (JSON lines). Requests on stdin: ``{"id": n, "argv": [...], "env": {...}, "log": path}``.
Replies on stdout: ``{"id": n, "pid": p}`` (or ``{"id": n, "error": text}``) once forked, then
``{"pid": p, "returncode": r}`` when it ends. The zygote exits when its stdin closes (the dispatcher
ended or died); children it leaves behind keep running in their own sessions, and the sweep of dead
dispatchers kills them as it would plain harness processes (environments/sweep.py).

``Zygote`` is the dispatcher's side: ``pid = await zygote.spawn(argv, env, log)``, then
``await zygote.wait(pid)``; a zygote that died fails its pending waits with ``ZygoteLost`` and is
started again by the next spawn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TARGET = "environments.harness:main"


class ZygoteLost(RuntimeError):
    """The zygote process ended while a child of it was still being waited for."""


# -- the zygote process ------------------------------------------------------------------------


def _load(target: str) -> Callable[[list[str]], int]:
    module, _, name = target.partition(":")
    if not name:
        raise ValueError(f"target {target!r} must be module:function")
    return getattr(importlib.import_module(module), name)


def _child(main: Callable[[list[str]], int], request: dict[str, Any], keep: set[int]) -> None:
    """In the forked child: become the plain harness process the dispatcher asked for, run, exit."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in {log, null, *keep}:
            with contextlib.suppress(OSError):
                os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams, open until _exit
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        result = main(list(request["argv"]))
        code = int(result or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(target: str = DEFAULT_TARGET) -> int:
    main = _load(target)  # the import this process exists for
    replies = os.dup(1)
    os.dup2(2, 1)  # a stray print of the zygote goes to stderr, never into the protocol
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears SIGCHLD

    def reply(message: dict[str, Any]) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})

    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_read], [], [])
        if wake_read in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
        reap()
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return 0  # the dispatcher is gone
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                reply({"id": request["id"], "error": f"fork failed: {exc}"})
                continue
            if pid == 0:
                _child(main, request, {replies, wake_read, wake_write})
            reply({"id": request["id"], "pid": pid})


# -- the dispatcher's side ---------------------------------------------------------------------


class Zygote:
    """Spawns harness processes through a zygote process (started at the first spawn, and again
    after one died). Use from one event loop; ``close()`` when the batch is done."""

    def __init__(self, env: dict[str, str], target: str = DEFAULT_TARGET):
        self.env, self.target = env, target
        self.process: asyncio.subprocess.Process | None = None
        self.reader: asyncio.Task | None = None
        self.next_id = 0
        self.spawning: dict[int, asyncio.Future] = {}
        self.exits: dict[int, asyncio.Future] = {}
        self.lock = asyncio.Lock()

    async def _ensure(self) -> asyncio.subprocess.Process:
        if (
            self.process is None
            or self.process.returncode is not None
            or self.reader is None
            or self.reader.done()
        ):
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "environments.zygote", "--target", self.target,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=self.env,
            )  # fmt: skip
            self.reader = asyncio.create_task(self._read(self.process))
        return self.process

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        try:
            while line := await process.stdout.readline():
                message = json.loads(line)
                if "id" in message:
                    future = self.spawning.pop(message["id"], None)
                    if future is None or future.done():
                        continue
                    if "error" in message:
                        future.set_exception(OSError(message["error"]))
                    else:  # a pid is new until its exit is reported, so this never replaces a live one
                        self.exits[message["pid"]] = asyncio.get_running_loop().create_future()
                        future.set_result(message["pid"])
                else:
                    exited = self.exits.get(message["pid"])
                    if exited is not None and not exited.done():
                        exited.set_result(int(message["returncode"]))
        finally:
            await process.wait()
            lost = ZygoteLost(f"the harness zygote ended (exit code {process.returncode})")
            for future in [*self.spawning.values(), *self.exits.values()]:
                if not future.done():
                    future.set_exception(lost)
                    future.exception()  # retrieved: only a waiter, if there is one, needs to see it
            self.spawning.clear()

    async def spawn(self, argv: list[str], env: dict[str, str], log_path: str) -> int:
        """Forks a harness process running ``main(argv)``; returns its pid (= its process group)."""
        async with self.lock:
            process = await self._ensure()
            self.next_id += 1
            future = asyncio.get_running_loop().create_future()
            self.spawning[self.next_id] = future
            request = {"id": self.next_id, "argv": argv, "env": env, "log": str(log_path)}
            assert process.stdin is not None
            process.stdin.write((json.dumps(request) + "\n").encode())
            await process.stdin.drain()
        return await future

    async def wait(self, pid: int) -> int:
        """The child's exit code (negative: the signal that killed it). Cancelling this wait (a
        deadline) leaves the child's exit to be waited for again."""
        future = self.exits[pid]
        try:
            return await asyncio.shield(future)
        finally:
            if future.done():
                self.exits.pop(pid, None)

    async def close(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        assert process.stdin is not None
        process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()
        if self.reader is not None:
            with contextlib.suppress(Exception):
                await self.reader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m environments.zygote", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="module:function called with the argv")
    return serve(parser.parse_args(argv).target)


if __name__ == "__main__":
    sys.exit(main())
