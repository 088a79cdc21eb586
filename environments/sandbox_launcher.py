"""The sandbox's launcher: run as a script (``python -I -S sandbox_launcher.py <spec JSON>``), it builds
a command's isolation and becomes the command. Standard library only, and nothing of gyrerl: it starts
in about one Python start-up, and the command it runs can import none of our packages.

Processes of one command: the launcher (L; joins the cgroup, unshares, builds the mounts) forks an init
(I: PID 1 of the new namespace: mounts /proc, reaps, reports the command's wait status) which forks the
command (limits, capabilities dropped, ``execve bash``). The command is not PID 1 because PID 1 ignores
the kernel's SIGXCPU and SIGXFSZ. The three share one process group, which the parent kills with
SIGKILL at the wall clock; the init's death takes every process of the namespace with it. A setup that
fails says so on stderr with SETUP_FAILED and exits SETUP_EXIT, so the parent tells it from a command
that failed.

The spec (environments/sandbox.py builds it): workspace, hide_root, network, filesystem (which
namespaces to make), cgroup (its folder or null), limits (SandboxLimits as a dict), argv, env, keep
(interpreter folders, or a confined harness's files, to mount back read-only), checkout and packages
(our source, covered), pass_fds (open files only the command keeps), and optionally listen ({"port",
"fd"}: a loopback listener of the new network namespace to hand the parent, see _hand_out_listener).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import stat
import sys
from pathlib import Path

SETUP_FAILED = "gyre-sandbox: setup failed:"  # the launcher's stderr prefix when isolation breaks
SETUP_EXIT = 125

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
MNT_DETACH = 2
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


class Libc:
    """The libc calls the sandbox makes (mount, mount_setattr, prctl, ...), errors raised as OSError."""

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

    def umount(self, target: str) -> None:
        self.check(self.lib.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def launch(spec: dict) -> None:
    """Launcher (L): joins the cgroup, unshares, builds the mounts, forks the namespace's init (I),
    waits, and exits the way the command did."""
    import resource  # noqa: F401  (loaded now: its folder may be covered once the mounts are built)

    libc = Libc()
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
        if spec.get("listen"):
            _hand_out_listener(spec["listen"])
    if spec["filesystem"]:
        _build_mounts(libc, spec)
    status_read, status_write = os.pipe()
    init_pid = os.fork()
    if init_pid == 0:
        os.close(status_read)
        _init(libc, spec, status_write)
    os.close(status_write)
    _close_passed(spec)  # they are the command's alone
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


def _init(libc: Libc, spec: dict, status_write: int) -> None:
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
        _close_passed(spec)
        while True:
            pid, status = os.wait()
            if pid == command_pid:
                os.write(status_write, str(status).encode())
                os._exit(0)
    except BaseException as exc:
        os.write(2, f"{SETUP_FAILED} {exc}\n".encode())
        os._exit(SETUP_EXIT)


def _close_passed(spec: dict) -> None:
    """Closes the files passed for the command (``pass_fds``) in the launcher or the init."""
    for fd in spec.get("pass_fds", []):
        with contextlib.suppress(OSError):
            os.close(fd)


def _loopback_up() -> None:
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        current = struct.unpack("16sH22x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH22x", b"lo", current | iff_up))


def _hand_out_listener(listen: dict) -> None:
    """A TCP socket listening on 127.0.0.1:<port> of the new network namespace, handed to the parent
    over the Unix socket ``listen["fd"]`` (SCM_RIGHTS): the parent accepts on it from the host's
    namespace and relays each connection to the gateway, the one address a confined harness reaches."""
    import socket

    report = socket.socket(fileno=listen["fd"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", listen["port"]))
        listener.listen(128)
        socket.send_fds(report, [b"L"], [listener.fileno()])
    report.close()  # the command must not inherit it


def _under(path: str, folders: list[str]) -> bool:
    return any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in folders)


VISIBLE_TOP = frozenset(
    {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "tmp", "run"}
)
"""Top-level folders a command sees (read-only; /tmp, /run, /dev fresh): every other one (/root,
/home, /work, /srv, /opt, /var, /sys, ...) is covered by an empty tmpfs."""
MASKED_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers")
MASKED_DIRS = ("/etc/ssh", "/etc/sudoers.d", "/etc/ssl/private")


def _cover(libc: Libc, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    libc.mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")


def _build_mounts(libc: Libc, spec: dict) -> None:
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
    keep = spec.get("keep", [])
    for path in keep:
        inside_another = _under(path, [other for other in keep if other != path])  # comes with it
        if _under(path, covered) and not _under(path, [workspace]) and not inside_another:
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
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(path, exist_ok=True)
        else:  # a single file (a harness's script): its mount point is a file
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a"):
                pass
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


def _become_command(libc: Libc, spec: dict) -> None:
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


def _drop_capabilities(libc: Libc) -> None:
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
        launch(json.loads(sys.argv[1]))
    except BaseException as exc:  # the command never started: say why, distinctly
        os.write(2, f"{SETUP_FAILED} {exc}\n".encode())
        os._exit(SETUP_EXIT)
