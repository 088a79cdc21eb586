"""The sandbox: each limit stops a real command, commands have no network, cannot write outside
their workspace and keep no capability, the wall clock kills the whole process group, and the file
tools refuse (and count) every path escape."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import pytest

from environments.sandbox import Sandbox, SandboxLimits, SandboxViolation, probe_isolation

ISOLATION = probe_isolation()
needs_fs = pytest.mark.skipif(not ISOLATION.filesystem, reason=f"no mount/pid namespaces: {ISOLATION.detail}")
needs_net = pytest.mark.skipif(not ISOLATION.network, reason=f"no network namespace: {ISOLATION.detail}")
needs_pids = pytest.mark.skipif(ISOLATION.pids_cgroup is None, reason=f"no pids cgroup: {ISOLATION.detail}")


def make(tmp_path: Path, name: str = "ws", **limits) -> Sandbox:
    return Sandbox.create(tmp_path / "root", name, {"hello.txt": "hi\n"}, limits=SandboxLimits(**limits))


def processes_named(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_command_runs_in_its_workspace_with_a_minimal_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_SECRET", "leaked")
    sandbox = make(tmp_path)

    result = sandbox.run('cat hello.txt; pwd; echo "$HOME"; echo "secret=${GYRE_TEST_SECRET:-}"; exit 3')

    assert result.stdout.splitlines() == ["hi", str(sandbox.workspace), str(sandbox.workspace), "secret="]
    assert (result.returncode, result.timed_out, result.limit) == (3, False, None)


def test_stdin_reaches_the_command(tmp_path):
    result = make(tmp_path).run("tr a-z A-Z", stdin="shout\n")

    assert result.stdout == "SHOUT\n"


def test_cpu_limit_kills_a_busy_loop(tmp_path):
    sandbox = make(tmp_path, cpu_s=1)

    result = sandbox.run("python -c 'while True: pass'")

    assert result.limit == "cpu"
    assert result.returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU)
    assert result.wall_s < 15


def test_memory_limit_refuses_a_2gb_allocation(tmp_path):
    sandbox = make(tmp_path, memory_bytes=512 << 20)

    result = sandbox.run("python -c 'b = bytearray(2 << 30); print(\"allocated\")'")

    assert result.returncode != 0
    assert "allocated" not in result.stdout
    assert result.limit == "memory"


@pytest.mark.parametrize(
    "command",
    ["head -c 3000000 /dev/zero > big.bin", "python -c \"open('big.bin', 'wb').write(b'0' * 3000000)\""],
    ids=["shell", "python"],
)
def test_file_size_limit_stops_a_large_write(tmp_path, command):
    sandbox = make(tmp_path, file_size_bytes=1 << 20)

    result = sandbox.run(command)

    assert result.returncode != 0
    assert result.limit == "file_size"
    assert (sandbox.workspace / "big.bin").stat().st_size <= 1 << 20


@needs_pids
def test_process_limit_bounds_a_fork_loop(tmp_path):
    sandbox = make(tmp_path, processes=16)
    fork_loop = (
        "import os, sys, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
        "print(n)\n"
        "sys.exit(1 if n < 200 else 0)\n"
    )
    sandbox.write_file("fork.py", fork_loop)

    result = sandbox.run("python fork.py")

    assert 0 < int(result.stdout) < 16
    assert result.limit == "processes"


def test_wall_limit_kills_the_whole_process_group(tmp_path):
    marker = f"gyre-wall-{uuid.uuid4().hex}"
    sandbox = make(tmp_path)

    result = sandbox.run(f"(exec -a {marker} sleep 100) & exec -a {marker} sleep 100", timeout_s=1)

    assert (result.timed_out, result.limit) == (True, "wall")
    assert result.wall_s < 5
    assert processes_named(marker) == []


@needs_fs
def test_background_processes_end_with_their_command(tmp_path):
    marker = f"gyre-bg-{uuid.uuid4().hex}"

    result = make(tmp_path).run(f"(exec -a {marker} sleep 100) & echo started")

    assert (result.stdout, result.timed_out) == ("started\n", False)
    assert result.wall_s < 5
    assert processes_named(marker) == []


def test_execution_wall_clock_spans_commands(tmp_path):
    sandbox = make(tmp_path, execution_wall_s=1.5, command_wall_s=30)

    first = sandbox.run("sleep 10")
    second = sandbox.run("echo never")

    assert (first.timed_out, first.limit) == (True, "wall")
    assert first.wall_s < 5
    assert (second.timed_out, second.limit, second.stdout) == (True, "wall", "")


CONNECT = "python -c 'import socket, sys; socket.create_connection((\"127.0.0.1\", int(sys.argv[1])), timeout=3)' {}"


@needs_net
def test_commands_have_no_network(tmp_path, listening_port):
    sandbox = make(tmp_path)

    result = sandbox.run(CONNECT.format(listening_port))

    assert sandbox.network_isolated
    assert result.returncode != 0
    assert "Connection refused" in result.stderr or "unreachable" in result.stderr


def test_network_true_allows_the_same_connection(tmp_path, listening_port):
    sandbox = make(tmp_path, network=True)

    result = sandbox.run(CONNECT.format(listening_port))

    assert not sandbox.network_isolated
    assert result.returncode == 0, result.stderr


@needs_fs
def test_commands_cannot_write_outside_the_workspace(tmp_path):
    sandbox = make(tmp_path)
    Sandbox.create(tmp_path / "root", "other", {"secret.txt": "the other execution's answer"})
    token = uuid.uuid4().hex
    host_paths = [Path(f"/var/tmp/gyre-outside-{token}"), Path(f"/root/gyre-outside-{token}")]
    in_tmp = [tmp_path / "outside.txt", Path(f"/tmp/gyre-outside-{token}")]

    result = sandbox.run(
        f"echo a > {host_paths[0]}; echo b > {host_paths[1]}; cat ../other/secret.txt; "
        f"echo c > {in_tmp[0]} && echo d > {in_tmp[1]} && cat {in_tmp[1]}; echo e > inside.txt"
    )

    assert sandbox.filesystem_isolated
    for path in host_paths:  # a read-only or an empty, sealed folder: the write fails either way
        assert f"{path}: Read-only file system" in result.stderr or f"{path}: No such file" in result.stderr
    assert "secret.txt: No such file" in result.stderr  # the sibling workspace is hidden
    assert result.stdout == "d\n"  # /tmp is private: writable, and gone with the command
    assert not any(path.exists() for path in host_paths + in_tmp)
    assert (sandbox.workspace / "inside.txt").read_text() == "e\n"


@needs_fs
def test_commands_hold_no_capabilities_and_see_only_their_processes(tmp_path):
    result = make(tmp_path).run(
        f"grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status; mount -t tmpfs none /mnt || echo mount-refused; "
        f"kill -0 {os.getpid()} || echo kill-refused; echo x > /proc/sys/kernel/hostname || echo sysctl-refused"
    )

    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "CapPrm:\t0000000000000000",
        "CapEff:\t0000000000000000",
        "CapBnd:\t0000000000000000",
    ]
    assert lines[3:] == ["mount-refused", "kill-refused", "sysctl-refused"]


def test_output_keeps_head_and_tail_within_the_bound(tmp_path):
    sandbox = make(tmp_path, output_bytes=1000)

    result = sandbox.run("python -c \"print('START' + 'a' * 20000); print('END')\"")

    assert result.truncated
    assert result.stdout.startswith("START") and result.stdout.endswith("END\n")
    assert len(result.stdout) < 1100


def test_arun_has_the_same_semantics(tmp_path):
    sandbox = make(tmp_path)

    async def both():
        return await asyncio.gather(
            sandbox.arun("cat; cat hello.txt", stdin="from stdin\n"), sandbox.arun("sleep 100", timeout_s=1)
        )

    done, slow = asyncio.run(both())

    assert (done.returncode, done.stdout) == (0, "from stdin\nhi\n")
    assert (slow.timed_out, slow.limit) == (True, "wall")
    assert slow.wall_s < 5


# -- path-checked file tools ----------------------------------------------------------------------
def test_path_escapes_are_refused_and_counted(tmp_path):
    sandbox = make(tmp_path)
    outside_dir = tmp_path / "outside"
    outside_dir.mkdir()
    (sandbox.workspace / "to_tmp").symlink_to(outside_dir)
    (sandbox.workspace / "passwd_link").symlink_to("/etc/passwd")

    attempts = [
        lambda: sandbox.resolve("../x"),
        lambda: sandbox.read_file("/etc/passwd"),
        lambda: sandbox.write_file("to_tmp/planted.txt", "x"),
        lambda: sandbox.read_file("passwd_link"),
        lambda: sandbox.write_file("a/../../escape.txt", "x"),
        lambda: sandbox.list_files(".."),
    ]
    for attempt in attempts:
        with pytest.raises(SandboxViolation):
            attempt()

    assert len(sandbox.violations) == len(attempts)
    assert "'../x' escapes" in sandbox.violations[0]
    assert "symlink" in sandbox.violations[2]
    assert list(outside_dir.iterdir()) == []
    assert not (tmp_path / "root" / "escape.txt").exists()


def test_paths_inside_the_workspace_are_allowed(tmp_path):
    sandbox = make(tmp_path)
    (sandbox.workspace / "alias.txt").symlink_to("hello.txt")

    sandbox.write_file("src/pkg/mod.py", "x = 1\n")
    sandbox.write_file("src/__pycache__/mod.pyc", "junk")

    assert sandbox.read_file(str(sandbox.workspace / "hello.txt")) == "hi\n"
    assert sandbox.read_file("alias.txt") == "hi\n"
    assert sandbox.read_file("src/./pkg/../pkg/mod.py") == "x = 1\n"
    assert sandbox.list_files() == ["alias.txt", "hello.txt", "src/pkg/mod.py"]
    assert sandbox.list_files("src") == ["src/pkg/mod.py"]
    assert sandbox.violations == []


def test_read_file_is_bounded(tmp_path):
    sandbox = make(tmp_path)
    sandbox.write_file("big.txt", "x" * 5000)

    text = sandbox.read_file("big.txt", max_bytes=100)

    assert text.startswith("x" * 100)
    assert "truncated: showed 100 of 5000 bytes" in text


def test_create_refuses_bad_names_and_reuse(tmp_path):
    make(tmp_path, "taken")

    with pytest.raises(FileExistsError):
        make(tmp_path, "taken")
    with pytest.raises(ValueError):
        make(tmp_path, "../up")
    with pytest.raises(SandboxViolation):
        Sandbox.create(tmp_path / "root", "bad", {"../../x.txt": "x"})


@needs_fs
def test_the_interpreter_stays_visible_when_it_lives_under_tmp(tmp_path):
    """A checkout and its venv in /tmp (as CI may place them): /tmp is private in the sandbox, but the
    interpreter's folders are mounted back read-only, so `python` still runs."""
    tools = tmp_path / "venv" / "bin"
    tools.mkdir(parents=True)
    (tools / "hello").write_text("#!/bin/sh\necho hello from $0\n")
    (tools / "hello").chmod(0o755)
    sandbox = make(tmp_path)
    hidden = sandbox.run(f"{tools}/hello")
    assert hidden.returncode == 127  # under /tmp, so not visible by default
    sandbox.visible_paths.append(str(tools.parent))
    shown = sandbox.run(f"{tools}/hello && touch {tools}/new")
    assert shown.stdout == f"hello from {tools}/hello\n"
    assert "Read-only file system" in shown.stderr and not (tools / "new").exists()
    assert sandbox.run("python -c 'print(6 * 7)'").stdout == "42\n"


@needs_fs
def test_disk_quota_bounds_bytes_and_files_of_a_workspace(tmp_path):
    sandbox = make(tmp_path, disk_bytes=8 << 20, disk_files=200)
    try:
        assert sandbox.disk_quota_enforced and (sandbox.workspace / "hello.txt").read_text() == "hi\n"
        result = sandbox.run(
            "for i in $(seq 20); do head -c 1000000 /dev/zero > big$i 2>/dev/null || echo full $i; done; "
            "for i in $(seq 400); do touch empty$i 2>/dev/null || { echo nofiles $i; break; }; done"
        )
        used_bytes, used_files = sandbox.disk_used()
        assert "full" in result.stdout and "nofiles" in result.stdout
        assert used_bytes <= 8 << 20 and used_files <= 200
        # the workspace keeps working: a small file still fits after deleting the big ones
        assert sandbox.run("rm big*; echo ok > small.txt && cat small.txt").stdout == "ok\n"
    finally:
        sandbox.release()
    assert not sandbox.disk_quota_enforced and list(sandbox.workspace.iterdir()) == []
