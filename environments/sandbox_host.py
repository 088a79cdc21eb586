"""The sandbox's parent side: starting one command through the launcher and collecting what it did.

    launch = Launch(spec, workspace, stdin, timeout_s, output_bytes, cgroup_base, processes)
    ended = launch.run()            # or: await launch.arun(); an Exit (returncode, output, timing)

``Launch`` makes the command's pids cgroup, starts ``python -I -S sandbox_launcher.py <spec>`` in a
session of its own, feeds its stdin, keeps the head and tail of its output (``Capture``), kills its
whole process group when it ends or at the wall clock, and removes the cgroup (counting the forks it
refused). ``which_limit`` reads which limit stopped a command from how it ended. Also here: what the
kernel grants (``pids_cgroup_base``), the workspace quota mounts (``mount_quota``, ``unmount``,
``release_mounts``) and the folders a command must not see (``own_packages``, ``own_checkout``) or must
see (``interpreter_paths``). environments/sandbox.py is the API these serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from environments import sandbox_launcher
from environments.sandbox_launcher import MS_NODEV, MS_NOSUID, Libc

logger = logging.getLogger(__name__)

MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


def launcher_argv(spec: dict[str, Any]) -> list[str]:
    """The launcher's command line for ``spec`` (isolated, no site: it starts fast and sees nothing of ours)."""
    return [sys.executable, "-I", "-S", os.path.abspath(sandbox_launcher.__file__), json.dumps(spec)]


class Capture:
    """Keeps the first and last ``limit // 2`` bytes of a stream."""

    def __init__(self, limit: int):
        self.limit = max(limit, 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        keep = self.limit - self.limit // 2
        if len(self.tail) > keep:
            del self.tail[:-keep]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        if not self.truncated:
            return (self.head + self.tail).decode("utf-8", errors="replace")
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        dropped = self.total - len(self.head) - len(self.tail)
        return f"{head}\n...[{dropped} bytes of output truncated]...\n{tail}"


@dataclass
class Exit:
    """How one launched command ended, as its parent saw it."""

    returncode: int
    stdout: Capture
    stderr: Capture
    wall_s: float
    timed_out: bool
    refused_forks: int
    """Forks its pids cgroup refused (the process limit was hit)."""


@dataclass
class Launch:
    """One command to start through the launcher: its spec (the cgroup is made per start), its folder,
    its stdin, its wall clock, how much of each output stream to keep, and its pids cgroup."""

    spec: dict[str, Any]
    cwd: Path
    stdin: bytes | None
    timeout_s: float
    output_bytes: int
    cgroup_base: str | None
    processes: int
    pass_fds: tuple[int, ...] = ()
    """Open files the command inherits (``Sandbox.run``)."""

    def run(self) -> Exit:
        cgroup = make_cgroup(self.cgroup_base, self.processes)
        started = time.monotonic()
        out, err = Capture(self.output_bytes), Capture(self.output_bytes)
        try:
            proc = subprocess.Popen(launcher_argv({**self.spec, "cgroup": cgroup}), **self._popen())
            try:
                timed_out = _pump(proc, self.stdin, out, err, started + self.timeout_s)
            finally:
                kill_group(proc.pid)
                proc.wait()
        finally:
            refused = close_cgroup(cgroup)
        return Exit(proc.returncode, out, err, time.monotonic() - started, timed_out, refused)

    async def arun(self) -> Exit:
        """``run`` as an asyncio subprocess: also killed when the awaiting task is cancelled."""
        cgroup = make_cgroup(self.cgroup_base, self.processes)
        begun = time.monotonic()
        captures = Capture(self.output_bytes), Capture(self.output_bytes)
        try:
            argv = launcher_argv({**self.spec, "cgroup": cgroup})
            proc = await asyncio.create_subprocess_exec(*argv, **self._popen())
            streams = (proc.stdout, proc.stderr)
            readers = [asyncio.ensure_future(_drain(s, c)) for s, c in zip(streams, captures, strict=True)]
            if self.stdin is not None:
                readers.append(asyncio.ensure_future(_feed(proc.stdin, self.stdin)))
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), self.timeout_s)
            except TimeoutError:
                timed_out = True
            finally:  # also on cancellation: nothing of the command outlives the call
                kill_group(proc.pid)
                await proc.wait()
                _, pending = await asyncio.wait(readers, timeout=1.0)
                for task in pending:
                    task.cancel()
        finally:
            refused = close_cgroup(cgroup)
        return Exit(proc.returncode, *captures, time.monotonic() - begun, timed_out, refused)

    def _popen(self) -> dict[str, Any]:
        return {
            "stdin": subprocess.PIPE if self.stdin is not None else subprocess.DEVNULL,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
            "cwd": self.cwd,
            "env": {},
            "start_new_session": True,
            "pass_fds": self.pass_fds,
        }


async def _drain(stream: asyncio.StreamReader, capture: Capture) -> None:
    while chunk := await stream.read(65536):
        capture.feed(chunk)


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stream.write(data)
        await stream.drain()
        stream.close()


def _pump(proc: subprocess.Popen, data: bytes | None, out: Capture, err: Capture, deadline: float) -> bool:
    """Moves stdin/stdout/stderr until the pipes close and the launcher exits, or the deadline;
    returns True on timeout."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    if data is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    pending = memoryview(data or b"")
    exited = False
    try:
        while len(sel.get_map()) > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return not exited
            for key, _ in sel.select(remaining):
                if key.data == "exit":
                    # what the command left behind must not hold the pipes open
                    sel.unregister(pidfd)
                    exited = True
                    kill_group(proc.pid)
                    deadline = min(deadline, time.monotonic() + 1.0)
                elif key.data == "stdin":
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fileobj)
                        proc.stdin.close()
                elif chunk := os.read(key.fd, 65536):
                    key.data.feed(chunk)
                else:
                    sel.unregister(key.fileobj)
        return False
    finally:
        sel.close()
        os.close(pidfd)
        if proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(OSError):
                proc.stdin.close()


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def close_cgroup(path: str | None) -> int:
    """Kills what is left in a command's cgroup, removes it; returns the refused forks."""
    if path is None:
        return 0
    refused = 0
    with contextlib.suppress(OSError):
        for line in Path(path, "pids.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "max":
                refused = int(value)
    for _ in range(200):
        with contextlib.suppress(OSError):
            for pid in Path(path, "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            os.rmdir(path)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.005)  # killed tasks take a moment to leave
    else:
        logger.warning("could not remove the sandbox cgroup %s", path)
    return refused


def which_limit(returncode: int, stderr: str, timed_out: bool, refused_forks: int) -> str | None:
    if timed_out:
        return "wall"
    if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "cpu"
    if returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or (
        returncode != 0 and "File too large" in stderr
    ):
        return "file_size"
    if refused_forks > 0:
        return "processes"
    if returncode != 0 and any(marker in stderr for marker in MEMORY_MARKERS):
        return "memory"
    if returncode != 0 and "Resource temporarily unavailable" in stderr and "fork" in stderr:
        return "processes"
    return None


def make_cgroup(base: str | None, processes: int) -> str | None:
    """A fresh pids cgroup under ``base`` for one command (None without a base)."""
    if base is None:
        return None
    path = os.path.join(base, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    Path(path, "pids.max").write_text(str(processes + 2))  # + the launcher and the init
    return path


def pids_cgroup_base(detail: list[str]) -> str | None:
    """A writable folder for per-command pids cgroups (v1 ``pids`` hierarchy or a v2 tree with the
    pids controller delegated), or None."""
    candidates = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, mount_point, fstype, options, *_ = line.split()
            if (fstype == "cgroup" and "pids" in options.split(",")) or fstype == "cgroup2":
                candidates.append(mount_point)
    for mount_point in candidates:
        base = os.path.join(mount_point, "gyre-sandbox")
        try:
            os.makedirs(base, exist_ok=True)
            test = os.path.join(base, f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.mkdir(test)
            try:
                Path(test, "pids.max").write_text("8")
            finally:
                os.rmdir(test)
            return base
        except OSError as exc:
            detail.append(f"pids cgroup under {mount_point}: {exc}")
    if not candidates:
        detail.append("no cgroup pids hierarchy mounted")
    return None


# -- workspace quota mounts ---------------------------------------------------------------------------
def mount_quota(workspace: Path, disk_bytes: int, disk_files: int, *, warn: bool = True) -> bool:
    """Makes ``workspace`` a tmpfs of ``disk_bytes`` and ``disk_files`` inodes; False (with a loud
    warning, unless ``warn`` is False) where the kernel refuses the mount."""
    options = f"mode=755,size={disk_bytes},nr_inodes={disk_files}"
    try:
        Libc().mount("tmpfs", str(workspace), "tmpfs", MS_NOSUID | MS_NODEV, options)
    except OSError as exc:
        if warn:
            logger.warning("WORKSPACE HAS NO DISK QUOTA: could not mount a tmpfs on %s (%s)", workspace, exc)
        return False
    return True


def unmount(path: str | Path) -> None:
    Libc().umount(str(path))


def release_mounts(root: str | Path) -> int:
    """Unmounts every quota tmpfs under ``root`` (the sandboxes of a dispatcher that was killed and
    never released them); returns how many. Only for a root no live dispatcher uses."""
    prefix = str(Path(root).resolve()) + os.sep
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for point in sorted(points, reverse=True):
        unmount(point)
    return len(points)


# -- what a command sees ------------------------------------------------------------------------------
OWN_PACKAGES = ("environments", "engines", "flows", "tasks", "trajectory_store", "scheduler", "sim", "bench")


@cache
def own_packages() -> list[str]:
    """Where gyrerl's own packages live (a checkout or site-packages): commands never see them, so a
    command cannot regenerate a problem, read a grader or a reference solution."""
    import importlib.util

    found = []
    for name in OWN_PACKAGES:
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations:
                found += [os.path.realpath(p) for p in spec.submodule_search_locations]
    return sorted(set(found))


@cache
def own_checkout() -> list[str]:
    """The source checkout holding this file (a folder with pyproject.toml above environments/), if
    any: commands see none of it (its venv, an interpreter folder, is mounted back read-only)."""
    root = Path(__file__).resolve().parent.parent
    return [str(root)] if (root / "pyproject.toml").is_file() and root != Path("/") else []


def interpreter_paths() -> list[str]:
    """Folders a command needs to run this Python (the venv and the base installation), resolved."""
    raw = (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))
    paths = {os.path.abspath(p) for p in raw} | {os.path.realpath(p) for p in raw}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    return sorted(p for p in paths if os.path.isdir(p))
