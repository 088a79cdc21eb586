"""A workspace sandbox for agent harnesses and graders: path-checked file tools plus limited commands.

Each execution gets its own workspace folder (``Sandbox.create(root, name)``). The file tools
(``resolve``, ``read_file``, ``write_file``, ``list_files``) are strict: every path is resolved
inside the workspace; absolute outside paths, ``..`` escapes and symlinks that lead outside raise
``SandboxViolation`` and are counted in ``Sandbox.violations``.

Commands (``run`` / ``arun``: ``bash -c``) start through a small launcher (this file, run as a
script) that applies, as far as the kernel allows:

* **network**: a fresh network namespace (only a loopback of its own), unless ``network=True``.
* **filesystem**: a private mount namespace in which every mount is read-only, nosuid and nodev,
  except the workspace (a bind mount, read-write), a private tmpfs on ``/tmp`` and ``/dev/shm``,
  an empty ``/run``, a minimal ``/dev`` (null, zero, full, random, urandom, tty) and a fresh
  read-only ``/proc``. Sibling workspaces under the ``Sandbox.create`` root are hidden. Writes to
  ``/tmp`` succeed but vanish with the command; nothing outside the workspace persists. The
  interpreter's folders (the venv, the base installation) stay visible read-only even when they
  live under a covered folder (a checkout in /tmp), so ``python`` works inside.
* **processes**: a fresh PID namespace (the command cannot see or signal anything outside it, and
  every process it started dies when it ends) and a cgroup ``pids.max`` limit.
* **privileges**: the command keeps uid 0 (the interpreter lives under ``/root``, which another uid
  could not reach) but loses every capability (bounding, permitted, effective, ambient; securebits
  locked, no_new_privs), so it can neither remount, mount, load modules nor bypass permissions.
* **limits** (``setrlimit``): CPU seconds, address space, file size, core 0; ``RLIMIT_NPROC`` too,
  although the kernel never applies it to uid 0, hence the cgroup.
* **wall clock**: per command and per execution; at the limit the whole process group is killed.

What is NOT enforced: reads are not restricted (root-owned files outside the workspace stay
readable); Unix sockets on mounts we do not cover remain connectable (``/run`` and ``/tmp`` are
covered); there is no seccomp filter. Where the kernel refuses a namespace or the cgroup, the
``Sandbox`` says so with ``logging.warning`` and a ``False`` flag (``network_isolated``,
``filesystem_isolated``, ``processes_enforced``) and runs the command with what remains.
``probe_isolation()`` (cached per process) tells what this machine grants.

Processes of one command: the launcher (``python -I -S sandbox.py <spec>``; joins the cgroup,
unshares, builds the mounts) forks an init (PID 1 of the new namespace: mounts /proc, reaps, reports
the command's wait status) which forks the command (limits, capabilities dropped, ``execve bash``).
The command is not PID 1 because PID 1 ignores the kernel's SIGXCPU and SIGXFSZ. The three share
one process group, killed with SIGKILL at the wall clock; the init's death takes every process of
the namespace with it. ``CommandResult.limit`` comes from the exit (SIGXCPU: "cpu", SIGXFSZ or
EFBIG: "file_size"), the cgroup's refused forks ("processes") and the error text of a failed
allocation ("memory": MemoryError, ENOMEM, bad_alloc). The launcher costs about one Python start
per command (0.1-0.3 s on a busy 2-core machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

SKIP_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".git"})
SETUP_FAILED = "gyre-sandbox: setup failed:"  # the launcher's stderr prefix when isolation breaks
SETUP_EXIT = 125
MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


@dataclass
class SandboxLimits:
    """Limits applied to every command of a sandbox."""

    cpu_s: int = 10
    """RLIMIT_CPU per process of a command: SIGXCPU at the limit, SIGKILL a second later."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS (address space) per process: allocations beyond it fail."""
    file_size_bytes: int = 16 << 20
    """RLIMIT_FSIZE: the largest file a command may write (SIGXFSZ / EFBIG beyond)."""
    processes: int = 64
    """Tasks (processes and threads) a command may have at once: a cgroup ``pids.max`` (uid 0 is
    exempt from RLIMIT_NPROC, which is also set for non-root runs)."""
    command_wall_s: float = 30.0
    """Wall clock per command; at the limit the command's whole process group is killed."""
    execution_wall_s: float | None = None
    """Wall clock for all commands of the sandbox, counted from its creation; None: no limit."""
    network: bool = False
    """False: commands run in a fresh network namespace (no network; a private loopback)."""
    output_bytes: int = 100_000
    """Captured bytes per stream (stdout, stderr); beyond it the head and tail are kept."""
    tmp_bytes: int = 256 << 20
    """Size of the private tmpfs on /tmp that a command sees (discarded when it ends)."""
    disk_bytes: int | None = None
    """Disk quota of a workspace made by ``Sandbox.create``: the workspace is a tmpfs of this size
    (writes beyond it fail with ENOSPC) until ``release()``; None: no quota (a plain folder)."""
    disk_files: int = 50_000
    """With ``disk_bytes``: the most files and folders the workspace may hold."""


class SandboxViolation(Exception):
    """A file-tool path that would leave the workspace: the message says what and which path."""


class SandboxSetupError(RuntimeError):
    """The launcher could not build the isolation the sandbox promised (not a command failure)."""


@dataclass
class CommandResult:
    """What a command did. ``run`` never raises for command failure."""

    returncode: int
    """Exit status; negative: killed by that signal."""
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    """The wall-clock limit (per command or per execution) was hit."""
    limit: str | None
    """Which limit stopped it: "wall", "cpu", "memory", "file_size", "processes"; None: none known."""
    truncated: bool = False
    """Output was longer than ``SandboxLimits.output_bytes`` and its middle was dropped."""


@dataclass(frozen=True)
class Isolation:
    """What the kernel lets the launcher do here (probed once per process)."""

    network: bool
    filesystem: bool
    pids_cgroup: str | None
    """The folder under which per-command pids cgroups are made; None: no cgroup available."""
    detail: tuple[str, ...] = ()
    """Why a feature is unavailable."""


class Sandbox:
    """One workspace and the commands run in it."""

    workspace: Path
    limits: SandboxLimits
    violations: list[str]
    network_isolated: bool
    filesystem_isolated: bool
    processes_enforced: bool
    env: dict[str, str]
    disk_quota_enforced: bool

    def __init__(
        self,
        workspace: str | Path,
        limits: SandboxLimits | None = None,
        *,
        hide_root: str | Path | None = None,
    ):
        """``hide_root``: a folder holding this and other workspaces; commands see it empty but for
        this workspace (``create`` sets it to its root)."""
        self.workspace = Path(workspace).resolve()
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.limits = limits or SandboxLimits()
        self.violations = []
        self.disk_quota_enforced = False
        """The workspace is a size-limited tmpfs (``SandboxLimits.disk_bytes``, set by create)."""
        self._hide_root = str(Path(hide_root).resolve()) if hide_root is not None else None
        self._started = time.monotonic()
        isolation = probe_isolation()
        self._isolation = isolation
        self.filesystem_isolated = isolation.filesystem
        self.network_isolated = isolation.network and not self.limits.network
        self.processes_enforced = isolation.pids_cgroup is not None or os.geteuid() != 0
        if not self.limits.network and not isolation.network:
            logger.warning(
                "SANDBOX HAS NETWORK: the kernel refused a network namespace, commands in %s can reach "
                "the network (%s)",
                self.workspace,
                "; ".join(isolation.detail),
            )
        if not isolation.filesystem:
            logger.warning(
                "SANDBOX CAN WRITE OUTSIDE ITS WORKSPACE: the kernel refused mount/pid namespaces, "
                "commands in %s write wherever uid %d can (%s)",
                self.workspace,
                os.geteuid(),
                "; ".join(isolation.detail),
            )
        if not self.processes_enforced:
            logger.warning(
                "SANDBOX PROCESS LIMIT NOT ENFORCED: running as root without a writable pids cgroup, "
                "RLIMIT_NPROC does not bind uid 0 (%s)",
                "; ".join(isolation.detail),
            )
        tool_dir = os.path.dirname(sys.executable)
        self.env = {
            "PATH": f"{tool_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.workspace),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        self.visible_paths = interpreter_paths()
        """Folders commands see read-only even under a covered folder (/tmp, the hide root): this
        interpreter's, so ``python`` works when the checkout and its venv live in /tmp."""

    @classmethod
    def create(
        cls,
        root: str | Path,
        name: str,
        template: Mapping[str, str | bytes] | str | Path | None = None,
        limits: SandboxLimits | None = None,
    ) -> Sandbox:
        """A new workspace ``root/name``, filled from a mapping (relative path -> content) or a folder."""
        if not name or name in {".", ".."} or "/" in name or "\x00" in name:
            raise ValueError(f"workspace name {name!r} must be one plain path component")
        root = Path(root).resolve()
        workspace = root / name
        if workspace.exists():
            raise FileExistsError(f"workspace {workspace} already exists: pick a new name per execution")
        workspace.mkdir(parents=True)
        quota = _mount_quota(workspace, limits) if limits and limits.disk_bytes else False
        if isinstance(template, str | Path):
            shutil.copytree(template, workspace, symlinks=True, dirs_exist_ok=True)
        sandbox = cls(workspace, limits, hide_root=root)
        sandbox.disk_quota_enforced = quota
        if isinstance(template, Mapping):
            for rel, content in template.items():
                sandbox._write(rel, content.encode() if isinstance(content, str) else content)
        return sandbox

    def release(self) -> None:
        """Unmounts the workspace's quota tmpfs (its files are gone after this); a no-op without one."""
        if self.disk_quota_enforced:
            _Libc().check(_Libc().lib.umount2(str(self.workspace).encode(), 2), f"umount {self.workspace}")
            self.disk_quota_enforced = False

    def disk_used(self) -> tuple[int, int]:
        """(bytes, files) the workspace holds now (the quota's measure)."""
        st = os.statvfs(self.workspace)
        if self.disk_quota_enforced:
            return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree
        total, count = 0, 0
        for dirpath, dirnames, filenames in os.walk(self.workspace):
            count += len(dirnames) + len(filenames)
            total += sum(os.lstat(os.path.join(dirpath, f)).st_size for f in filenames)
        return total, count

    # -- path-checked file tools --------------------------------------------------------------
    def resolve(self, path: str) -> Path:
        """The real path of ``path`` (relative to the workspace, or absolute) if it lies inside the
        workspace; otherwise records and raises ``SandboxViolation``."""
        if "\x00" in str(path):
            self._refuse(f"path {path!r} contains a NUL byte")
        candidate = Path(path)
        if not candidate.is_absolute():
            candidate = self.workspace / candidate
        resolved = candidate.resolve()
        if resolved != self.workspace and not resolved.is_relative_to(self.workspace):
            reason = "leads outside the workspace"
            if not Path(os.path.normpath(candidate)).is_relative_to(self.workspace):
                reason = "is outside the workspace" if Path(path).is_absolute() else "escapes with '..'"
            elif resolved != Path(os.path.normpath(candidate)):
                reason = f"goes through a symlink to {resolved}"
            self._refuse(f"path {path!r} {reason}")
        return resolved

    def read_file(self, path: str, max_bytes: int = 200_000) -> str:
        """The text of a workspace file (UTF-8, undecodable bytes replaced); a longer file is cut at
        ``max_bytes`` with a note saying so."""
        fd = self._open(path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(max_bytes + 1)
            if len(data) <= max_bytes:
                return data.decode("utf-8", errors="replace")
            size = os.fstat(handle.fileno()).st_size
        text = data[:max_bytes].decode("utf-8", errors="replace")
        return f"{text}\n...[truncated: showed {max_bytes} of {size} bytes]"

    def write_file(self, path: str, text: str) -> None:
        """Writes a workspace file (UTF-8), creating parent folders; never through a link outside."""
        self._write(path, text.encode())

    def list_files(self, path: str = ".") -> list[str]:
        """Files under ``path``, relative to the workspace, sorted; caches like __pycache__ skipped."""
        top = self.resolve(path)
        found = []
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for name in filenames:
                full = Path(dirpath, name)
                real = full.resolve()
                if real.is_file() and real.is_relative_to(self.workspace):
                    found.append(full.relative_to(self.workspace).as_posix())
        return sorted(found)

    def _refuse(self, message: str) -> None:
        self.violations.append(message)
        raise SandboxViolation(message)

    def _rel_parts(self, path: str) -> list[str]:
        resolved = self.resolve(path)
        return list(resolved.relative_to(self.workspace).parts)

    def _open(self, path: str, flags: int, create_dirs: bool = False) -> int:
        """Opens a resolved workspace path component by component with O_NOFOLLOW, so a symlink
        swapped in after ``resolve`` (by a concurrent command) is refused, not followed."""
        parts = self._rel_parts(path)
        if not parts:
            raise IsADirectoryError(f"{path!r} is the workspace folder, not a file")
        dir_fd = os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts[:-1]:
                if create_dirs:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=dir_fd)
                try:
                    next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                except FileNotFoundError:
                    raise
                except OSError:  # ELOOP / ENOTDIR: a symlink appeared after resolve()
                    self._refuse(f"path {path!r}: {part!r} changed into a link or file while opening")
                os.close(dir_fd)
                dir_fd = next_fd
            try:
                return os.open(parts[-1], flags | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    self._refuse(f"path {path!r} changed into a symlink while opening")
                raise
        finally:
            os.close(dir_fd)

    def _write(self, path: str, data: bytes) -> None:
        fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, create_dirs=True)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)

    # -- commands -----------------------------------------------------------------------------
    @property
    def remaining_s(self) -> float | None:
        """Seconds left of the execution's wall clock; None when it has none."""
        if self.limits.execution_wall_s is None:
            return None
        return self.limits.execution_wall_s - (time.monotonic() - self._started)

    def run(self, command: str, timeout_s: float | None = None, stdin: str | None = None) -> CommandResult:
        """Runs ``bash -c command`` in the workspace under the limits; never raises for its failure."""
        timeout = self._timeout(timeout_s)
        if timeout <= 0:
            return _deadline_result()
        cgroup = self._make_cgroup()
        refused_forks = 0
        started = time.monotonic()
        out, err = _Capture(self.limits.output_bytes), _Capture(self.limits.output_bytes)
        try:
            proc = subprocess.Popen(
                self._launcher_argv(command, cgroup),
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.workspace,
                env={},
                start_new_session=True,
            )
            try:
                data = stdin.encode() if stdin is not None else None
                timed_out = _pump(proc, data, out, err, started + timeout)
            finally:
                _kill_group(proc.pid)
                proc.wait()
        finally:
            refused_forks = _close_cgroup(cgroup)
        return self._result(proc.returncode, out, err, time.monotonic() - started, timed_out, refused_forks)

    async def arun(
        self, command: str, timeout_s: float | None = None, stdin: str | None = None
    ) -> CommandResult:
        """``run`` as an asyncio subprocess: same isolation, limits and result."""
        import asyncio  # here, not at the top: the launcher runs this file and should start fast

        timeout = self._timeout(timeout_s)
        if timeout <= 0:
            return _deadline_result()
        cgroup = self._make_cgroup()
        refused_forks = 0
        started = time.monotonic()
        out, err = _Capture(self.limits.output_bytes), _Capture(self.limits.output_bytes)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._launcher_argv(command, cgroup),
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.workspace,
                env={},
                start_new_session=True,
            )

            async def drain(stream, capture: _Capture) -> None:
                while chunk := await stream.read(65536):
                    capture.feed(chunk)

            async def feed_stdin() -> None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    proc.stdin.write(stdin.encode())
                    await proc.stdin.drain()
                    proc.stdin.close()

            readers = [
                asyncio.ensure_future(drain(proc.stdout, out)),
                asyncio.ensure_future(drain(proc.stderr, err)),
            ]
            if stdin is not None:
                readers.append(asyncio.ensure_future(feed_stdin()))
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                timed_out = True
            finally:  # also on cancellation: nothing of the command outlives the call
                _kill_group(proc.pid)
                await proc.wait()
                _, pending = await asyncio.wait(readers, timeout=1.0)
                for task in pending:
                    task.cancel()
        finally:
            refused_forks = _close_cgroup(cgroup)
        return self._result(proc.returncode, out, err, time.monotonic() - started, timed_out, refused_forks)

    def _timeout(self, timeout_s: float | None) -> float:
        timeout = self.limits.command_wall_s if timeout_s is None else timeout_s
        remaining = self.remaining_s
        return timeout if remaining is None else min(timeout, remaining)

    def _launcher_argv(self, command: str, cgroup: str | None) -> list[str]:
        spec = {
            "workspace": str(self.workspace),
            "hide_root": self._hide_root,
            "network": self.network_isolated,
            "filesystem": self.filesystem_isolated,
            "cgroup": cgroup,
            "limits": asdict(self.limits),
            "argv": [shutil.which("bash") or "/bin/bash", "-c", command],
            "env": self.env,
            "keep": self.visible_paths,
            "checkout": own_checkout(),
            "packages": own_packages(),
        }
        return [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(spec)]

    def _make_cgroup(self) -> str | None:
        base = self._isolation.pids_cgroup
        if base is None:
            return None
        path = os.path.join(base, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
        os.mkdir(path)
        Path(path, "pids.max").write_text(str(self.limits.processes + 2))  # + the launcher and the init
        return path

    def _result(
        self,
        returncode: int,
        out: _Capture,
        err: _Capture,
        wall_s: float,
        timed_out: bool,
        refused_forks: int,
    ) -> CommandResult:
        stderr = err.text()
        if SETUP_FAILED in stderr and returncode == SETUP_EXIT:
            raise SandboxSetupError(stderr.strip())
        limit = _which_limit(returncode, stderr, timed_out, refused_forks)
        return CommandResult(
            returncode=returncode,
            stdout=out.text(),
            stderr=stderr,
            wall_s=wall_s,
            timed_out=timed_out,
            limit=limit,
            truncated=out.truncated or err.truncated,
        )


# -- parent side helpers ------------------------------------------------------------------------
def _mount_quota(workspace: Path, limits: SandboxLimits) -> bool:
    """Makes ``workspace`` a tmpfs of ``limits.disk_bytes`` and ``disk_files`` inodes; False (with a
    loud warning) where the kernel refuses the mount."""
    libc = _Libc()
    options = f"mode=755,size={limits.disk_bytes},nr_inodes={limits.disk_files}"
    try:
        libc.mount("tmpfs", str(workspace), "tmpfs", MS_NOSUID | MS_NODEV, options)
    except OSError as exc:
        logger.warning("WORKSPACE HAS NO DISK QUOTA: could not mount a tmpfs on %s (%s)", workspace, exc)
        return False
    return True


class _Capture:
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


def _pump(proc: subprocess.Popen, data: bytes | None, out: _Capture, err: _Capture, deadline: float) -> bool:
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
                    _kill_group(proc.pid)
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


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _close_cgroup(path: str | None) -> int:
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


def _which_limit(returncode: int, stderr: str, timed_out: bool, refused_forks: int) -> str | None:
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


def _deadline_result() -> CommandResult:
    return CommandResult(
        returncode=124,
        stdout="",
        stderr="execution wall-clock limit reached: command not run",
        wall_s=0.0,
        timed_out=True,
        limit="wall",
    )


@cache
def probe_isolation() -> Isolation:
    """Finds, once per process, which namespaces and cgroups the kernel grants the launcher."""
    detail: list[str] = []

    def works(network: bool, filesystem: bool) -> bool:
        with tempfile.TemporaryDirectory(prefix="gyre-probe-") as workspace:
            spec = {
                "workspace": workspace,
                "hide_root": None,
                "network": network,
                "filesystem": filesystem,
                "cgroup": None,
                "limits": asdict(SandboxLimits()),
                "argv": ["/bin/sh", "-c", "exit 0"],
                "env": {"PATH": "/usr/bin:/bin"},
                "keep": interpreter_paths(),
            }
            probe = subprocess.run(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=60,
                env={},
            )
        if probe.returncode != 0:
            detail.append(f"network={network} filesystem={filesystem}: {probe.stderr.strip()[-300:]}")
        return probe.returncode == 0

    if works(True, True):
        network, filesystem = True, True
    else:
        network, filesystem = works(True, False), works(False, True)
    return Isolation(network, filesystem, _pids_cgroup_base(detail), tuple(detail))


def _pids_cgroup_base(detail: list[str]) -> str | None:
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


# -- the launcher (this file run as a script; stdlib only, starts fast) ---------------------------
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
AT_FDCWD, AT_EMPTY_PATH, AT_RECURSIVE = -100, 0x1000, 0x8000
OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 1, 4
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # the same number on every arch
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECURE_NOROOT_ALL_LOCKED = 0xEF  # noroot, no_setuid_fixup, keep_caps_locked, no_cap_ambient_raise (+locks)
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _Libc:
    def __init__(self):
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.syscall.restype = ctypes.c_long

    def check(self, result: int, what: str) -> int:
        if result < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")
        return result

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None):
        enc = lambda s: s.encode() if s is not None else None  # noqa: E731
        self.check(
            self.lib.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
            f"mount {fstype or source} on {target}",
        )

    def setattr(self, fd: int, path: str, flags: int, attr_set: int, attr_clr: int = 0):
        attr = _MountAttr(attr_set, attr_clr, 0, 0)
        self.check(
            self.lib.syscall(
                SYS_MOUNT_SETATTR, fd, path.encode(), flags, ctypes.byref(attr), ctypes.c_size_t(32)
            ),
            f"mount_setattr {path}",
        )

    def prctl(self, option: int, arg: int = 0):
        self.check(self.lib.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _launch(spec: dict) -> None:
    """Launcher (L): joins the cgroup, unshares, builds the mounts, forks the namespace's init (I),
    waits, and exits the way the command did."""
    import resource  # noqa: F401  (loaded now: its folder may be covered once the mounts are built)

    libc = _Libc()
    os.umask(0o022)
    if spec["cgroup"]:
        Path(spec["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    flags = (CLONE_NEWNET if spec["network"] else 0) | (
        CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC if spec["filesystem"] else 0
    )
    if flags:
        libc.check(libc.lib.unshare(flags), "unshare")
    if spec["network"]:
        _loopback_up()
    if spec["filesystem"]:
        _build_mounts(libc, spec)
    status_read, status_write = os.pipe()
    init_pid = os.fork()
    if init_pid == 0:
        os.close(status_read)
        _init(libc, spec, status_write)
    os.close(status_write)
    _, init_status = os.waitpid(init_pid, 0)
    reported = os.read(status_read, 64)
    # the init reports the command's raw wait status; without a report (it was killed), its own
    status = int(reported) if reported else init_status
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's disposition cannot be set
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _init(libc: _Libc, spec: dict, status_write: int) -> None:
    """PID 1 of the new PID namespace (I): mounts /proc, forks the command, reaps orphans until the
    command ends, reports its wait status. The command is not PID 1 itself because PID 1 ignores
    the kernel's SIGXCPU and SIGXFSZ. When I exits, the kernel kills everything left in it."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if spec["filesystem"]:
            libc.mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        command_pid = os.fork()
        if command_pid == 0:
            os.close(status_write)
            _become_command(libc, spec)
        while True:
            pid, status = os.wait()
            if pid == command_pid:
                os.write(status_write, str(status).encode())
                os._exit(0)
    except BaseException as exc:
        os.write(2, f"{SETUP_FAILED} {exc}\n".encode())
        os._exit(SETUP_EXIT)


def _loopback_up() -> None:
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        current = struct.unpack("16sH22x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH22x", b"lo", current | iff_up))


def _under(path: str, folders: list[str]) -> bool:
    return any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in folders)


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


VISIBLE_TOP = frozenset(
    {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "tmp", "run"}
)
"""Top-level folders a command sees (read-only; /tmp, /run, /dev fresh): every other one (/root,
/home, /work, /srv, /opt, /var, /sys, ...) is covered by an empty tmpfs."""
MASKED_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers")
MASKED_DIRS = ("/etc/ssh", "/etc/sudoers.d", "/etc/ssl/private")


def _cover(libc: _Libc, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    libc.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")


def _build_mounts(libc: _Libc, spec: dict) -> None:
    """Everything read-only, most of it invisible: only VISIBLE_TOP, the interpreter's folders and a
    clone of the workspace (read-write) remain; private /tmp, /run, /dev; the checkout and our own
    packages covered wherever they live."""
    workspace = spec["workspace"]
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do propagates to the host
    tree_fd = libc.check(
        libc.lib.syscall(
            SYS_OPEN_TREE, AT_FDCWD, workspace.encode(), OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
        ),
        f"open_tree {workspace}",
    )
    libc.setattr(tree_fd, "", AT_EMPTY_PATH | AT_RECURSIVE, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    libc.setattr(AT_FDCWD, "/", AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
    hide_root = spec["hide_root"] if spec["hide_root"] and spec["hide_root"] != "/" else None
    top = sorted(
        f"/{name}"
        for name in os.listdir("/")
        if name not in VISIBLE_TOP and os.path.isdir(f"/{name}") and not os.path.islink(f"/{name}")
    )
    checkout = [p for p in spec.get("checkout", []) if p != "/"]
    covered = ["/tmp", "/run", "/dev", *top, *checkout, *([hide_root] if hide_root else [])]
    kept = []  # the interpreter's folders, when they live under a folder we cover (a venv in /tmp)
    for path in spec.get("keep", []):
        if _under(path, covered) and not _under(path, [workspace]):
            fd = libc.check(
                libc.lib.syscall(
                    SYS_OPEN_TREE, AT_FDCWD, path.encode(), OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
                ),
                f"open_tree {path}",
            )
            libc.setattr(
                fd, "", AT_EMPTY_PATH | AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
            )
            kept.append((path, fd))
    libc.mount(
        "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={spec['limits']['tmp_bytes']}"
    )
    libc.mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=755,size=1m")
    libc.mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=1m")
    for name, (major, minor) in DEVICES.items():
        os.mknod(f"/dev/{name}", 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(f"/dev/{name}", 0o666)
    for name, target in {"fd": "/proc/self/fd", "stdin": "0", "stdout": "1", "stderr": "2"}.items():
        os.symlink(target if name == "fd" else f"/proc/self/fd/{target}", f"/dev/{name}")
    os.mkdir("/dev/shm")
    libc.mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")
    libc.setattr(AT_FDCWD, "/dev", 0, MOUNT_ATTR_RDONLY)
    for path in MASKED_FILES:
        if os.path.isfile(path):
            libc.mount("/dev/null", path, None, MS_BIND)
    for path in MASKED_DIRS:
        if os.path.isdir(path) and not os.path.islink(path):
            libc.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=755,size=4k")
    for path in [*top, *checkout, *([hide_root] if hide_root else [])]:
        _cover(libc, path)
    for path, fd in kept:
        os.makedirs(path, exist_ok=True)
        libc.check(
            libc.lib.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, path.encode(), MOVE_MOUNT_F_EMPTY_PATH),
            f"move_mount {path}",
        )
        os.close(fd)
    for path in spec.get("packages", []):  # our packages installed inside a kept tree (site-packages)
        if os.path.isdir(path) and not _under(workspace, [path]):
            libc.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=755,size=4k")
    os.makedirs(workspace, exist_ok=True)
    libc.check(
        libc.lib.syscall(SYS_MOVE_MOUNT, tree_fd, b"", AT_FDCWD, workspace.encode(), MOVE_MOUNT_F_EMPTY_PATH),
        f"move_mount {workspace}",
    )
    os.close(tree_fd)
    for path in [*top, *checkout, *([hide_root] if hide_root else [])]:  # mount points made: seal them
        libc.setattr(AT_FDCWD, path, 0, MOUNT_ATTR_RDONLY)


def _become_command(libc: _Libc, spec: dict) -> None:
    """The command's process: limits, no capabilities, exec; never returns."""
    import resource  # already loaded by _launch, before the mounts

    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.chdir(spec["workspace"])
        limits = spec["limits"]
        resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"], limits["file_size_bytes"]))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.geteuid() == 0:
            _drop_capabilities(libc)
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores some of these; the command must not
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:
        os.write(2, f"{SETUP_FAILED} {exc}\n".encode())
    finally:
        os._exit(SETUP_EXIT)


def _drop_capabilities(libc: _Libc) -> None:
    libc.prctl(PR_SET_SECUREBITS, SECURE_NOROOT_ALL_LOCKED)  # uid 0 regains nothing at execve
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last_cap + 1):
        libc.prctl(PR_CAPBSET_DROP, cap)
    libc.check(libc.lib.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all zero (two words each)
    libc.check(libc.lib.capset(header, data), "capset")
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1)


if __name__ == "__main__":
    try:
        _launch(json.loads(sys.argv[1]))
    except BaseException as exc:  # the command never started: say why, distinctly
        os.write(2, f"{SETUP_FAILED} {exc}\n".encode())
        os._exit(SETUP_EXIT)


def release_mounts(root: str | Path) -> int:
    """Unmounts every quota tmpfs under ``root`` (the sandboxes of a dispatcher that was killed and
    never released them); returns how many. Only for a root no live dispatcher uses."""
    prefix = str(Path(root).resolve()) + os.sep
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for point in sorted(points, reverse=True):
        _Libc().check(_Libc().lib.umount2(point.encode(), 2), f"umount {point}")
    return len(points)
