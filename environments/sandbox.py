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

A command starts through a small launcher (environments/sandbox_launcher.py, run as a script: the
launcher, an init as PID 1 of the new namespace, then the command), which the parent side
(environments/sandbox_host.py) starts, feeds, times and kills as one process group. ``CommandResult.limit``
comes from the exit (SIGXCPU: "cpu", SIGXFSZ or EFBIG: "file_size"), the cgroup's refused forks
("processes") and the error text of a failed allocation ("memory": MemoryError, ENOMEM, bad_alloc).
The launcher costs about one Python start per command (0.1-0.3 s on a busy 2-core machine).
An external harness process starts through the same launcher (``Sandbox.spec``), with the gateway as
its only reachable address: environments/sandbox_harness.py. ``release_keeping_files`` turns a quota
workspace kept for inspection into a plain folder.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from environments.sandbox_host import (
    Exit,
    Launch,
    interpreter_paths,
    launcher_argv,
    mount_quota,
    own_checkout,
    own_packages,
    pids_cgroup_base,
    unmount,
    which_limit,
)
from environments.sandbox_launcher import SETUP_EXIT, SETUP_FAILED
from environments.workspace_tree import link_inside, walk

logger = logging.getLogger(__name__)

SKIP_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".git"})


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
        quota = (
            mount_quota(workspace, limits.disk_bytes, limits.disk_files)
            if limits and limits.disk_bytes
            else False
        )
        try:
            if isinstance(template, str | Path):
                shutil.copytree(template, workspace, symlinks=True, dirs_exist_ok=True)
            sandbox = cls(workspace, limits, hide_root=root)
            sandbox.disk_quota_enforced = quota
            if isinstance(template, Mapping):
                for rel, content in template.items():
                    sandbox._write(rel, content.encode() if isinstance(content, str) else content)
        except BaseException:  # a template over the quota: no mount may outlive the failed create
            if quota:
                unmount(workspace)
            raise
        return sandbox

    @property
    def pids_cgroup(self) -> str | None:
        """The folder under which this sandbox's commands get their pids cgroups (None: none here)."""
        return self._isolation.pids_cgroup

    def release(self) -> None:
        """Unmounts the workspace's quota tmpfs (its files are gone after this); a no-op without one."""
        if self.disk_quota_enforced:
            unmount(self.workspace)
            self.disk_quota_enforced = False

    def release_keeping_files(self) -> None:
        """Unmounts the workspace's quota tmpfs and leaves its files at the same path, in a plain
        folder (copied aside under the root, then moved back): a workspace kept for inspection holds
        no mount (nor memory) once its execution ended. A no-op without a quota."""
        if not self.disk_quota_enforced:
            return
        aside = self.workspace.with_name(f".{self.workspace.name}.kept")
        shutil.copytree(self.workspace, aside, symlinks=True)
        self.release()
        self.workspace.rmdir()
        aside.rename(self.workspace)

    def disk_used(self) -> tuple[int, int]:
        """(bytes, files) the workspace holds now (the quota's measure)."""
        st = os.statvfs(self.workspace)
        if self.disk_quota_enforced:
            return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree
        total, count = 0, 0
        for item in walk(self.workspace, lambda rel, why: None, max_depth=1 << 20, max_path_bytes=1 << 20):
            count += 1
            total += item.info.st_size if not item.is_dir else 0
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
        resolved = Path(os.path.realpath(candidate))  # Path.resolve raises on a symlink loop
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
        """Files under ``path`` (and links to files inside the workspace), relative to the workspace,
        sorted; caches like __pycache__ skipped. Bounded like every walk of an agent's tree
        (environments/workspace_tree.py): no recursion, names and depths it cannot keep left out."""
        top = self.resolve(path)
        prefix = top.relative_to(self.workspace).as_posix()
        found = []
        for item in walk(
            top, lambda rel, why: None, descend=lambda rel: rel.rsplit("/", 1)[-1] not in SKIP_DIRS
        ):
            if item.is_file or (
                item.is_link and os.path.isfile(item.path) and link_inside(str(self.workspace), item.path)
            ):
                found.append(item.rel if prefix == "." else f"{prefix}/{item.rel}")
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

    def run(
        self,
        command: str,
        timeout_s: float | None = None,
        stdin: str | None = None,
        pass_fds: Sequence[int] = (),
    ) -> CommandResult:
        """Runs ``bash -c command`` in the workspace under the limits; never raises for its failure.

        ``pass_fds``: open files of this process the command inherits under the same numbers (only
        the command: the launcher and its init close them once the command has started). A file
        opened outside every folder the command sees reaches it only this way (the built-in pytest
        grader's report, environments/problems/pytest_grader.py)."""
        launch = self._launch(command, timeout_s, stdin, pass_fds)
        return _deadline_result() if launch is None else self._result(launch.run())

    async def arun(
        self, command: str, timeout_s: float | None = None, stdin: str | None = None
    ) -> CommandResult:
        """``run`` as an asyncio subprocess: same isolation, limits and result."""
        launch = self._launch(command, timeout_s, stdin)
        return _deadline_result() if launch is None else self._result(await launch.arun())

    def _launch(
        self, command: str, timeout_s: float | None, stdin: str | None, pass_fds: Sequence[int] = ()
    ) -> Launch | None:
        """The command as the launcher takes it; None when the execution's wall clock is spent."""
        timeout = self.limits.command_wall_s if timeout_s is None else timeout_s
        remaining = self.remaining_s
        if remaining is not None:
            timeout = min(timeout, remaining)
        if timeout <= 0:
            return None
        spec = self.spec([shutil.which("bash") or "/bin/bash", "-c", command], self.env)
        spec["pass_fds"] = list(pass_fds)
        data = stdin.encode() if stdin is not None else None
        output, cgroups = self.limits.output_bytes, self._isolation.pids_cgroup
        return Launch(
            spec, self.workspace, data, timeout, output, cgroups, self.limits.processes, tuple(pass_fds)
        )

    def spec(
        self,
        argv: list[str],
        env: dict[str, str],
        limits: SandboxLimits | None = None,
        visible: Sequence[str] = (),
    ) -> dict:
        """The launcher's spec for ``argv`` (an absolute program) in this workspace: the isolation
        this machine grants, ``limits`` (default: the sandbox's), and ``visible`` (folders or files
        the command sees read-only besides the interpreter's) ."""
        return {
            "workspace": str(self.workspace),
            "hide_root": self._hide_root,
            "network": self.network_isolated,
            "filesystem": self.filesystem_isolated,
            "limits": asdict(limits or self.limits),
            "argv": argv,
            "env": env,
            "keep": sorted({*self.visible_paths, *visible}),
            "checkout": own_checkout(),
            "packages": own_packages(),
        }

    def _result(self, ended: Exit) -> CommandResult:
        stderr = ended.stderr.text()
        if SETUP_FAILED in stderr and ended.returncode == SETUP_EXIT:
            raise SandboxSetupError(stderr.strip())
        return CommandResult(
            returncode=ended.returncode,
            stdout=ended.stdout.text(),
            stderr=stderr,
            wall_s=ended.wall_s,
            timed_out=ended.timed_out,
            limit=which_limit(ended.returncode, stderr, ended.timed_out, ended.refused_forks),
            truncated=ended.stdout.truncated or ended.stderr.truncated,
        )


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
                launcher_argv(spec),
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
    return Isolation(network, filesystem, pids_cgroup_base(detail), tuple(detail))
