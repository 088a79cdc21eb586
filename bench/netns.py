"""Test hosts: network namespaces that a test or a benchmark creates, each with an address only it holds.

    with hosts(["h1", "h2"]) as (h1, h2), engine_on(h1, folder, "A", token) as url:
        ...                                          # url: http://10.213.x.10:port, reachable from the
                                                     # root namespace and from h2

A bridge in the root namespace holds the first address of a private /24 (10.213.<n>.1) and a veth
pair joins each namespace to it (the namespace's end named eth0, at 10.213.<n>.<10 + i>); each
namespace's loopback is up. Traffic goes only to those addresses: nothing is routed elsewhere (the
namespaces have no default route). Everything is removed on exit, also after a failure.

Where the machine does not allow namespaces (not root, no `ip`), one warning says so and every host
is the loopback address with ``netns`` None: the same topology on loopback ports, one host in fact.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

from engines.net import free_port
from stack.stack import serving_process

_warned = False


@dataclass(frozen=True)
class TestHost:
    __test__ = False  # not a test class for pytest

    name: str
    address: str
    netns: str | None  # None: the loopback fallback (no namespace)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return argv if self.netns is None else ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), check=True, capture_output=True, text=True, **kwargs)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def namespaces_allowed() -> str | None:
    """None where this process may make network namespaces; else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command"
    if os.geteuid() != 0:
        return "not root"
    return None


@contextlib.contextmanager
def hosts(names: list[str]) -> Iterator[list[TestHost]]:
    global _warned
    why = namespaces_allowed()
    if why is not None:
        if not _warned:
            warnings.warn(f"test hosts run on loopback ports, not in network namespaces: {why}", stacklevel=3)
            _warned = True
        yield [TestHost(name, "127.0.0.1", None) for name in names]
        return
    tag = uuid.uuid4().hex[:6]
    subnet = f"10.213.{int(tag, 16) % 200 + 20}"
    bridge = f"gyrebr{tag}"
    made: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        out = []
        for i, name in enumerate(names):
            netns, veth = f"gyre-{tag}-{i}", f"gyv{tag}{i}"
            _ip("netns", "add", netns)
            made.append(netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            address = f"{subnet}.{10 + i}"
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            out.append(TestHost(name, address, netns))
        yield out
    finally:
        for netns in made:
            _kill_inside(netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _kill_inside(netns: str) -> None:
    """Every process still in ``netns`` killed: a cut-off host's cell serves on while its API is
    silent (flows/cell.py, by design), and once the namespace is deleted nothing could reach it (before
    2026-12-07 each three-host test left its cut host's cell run, engine and replica running)."""
    listed = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    for pid in (int(p) for p in listed.split() if p.isdigit()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def root_address(host: TestHost) -> str:
    """The root namespace's address on the hosts' network (the bridge's): where a host reaches a
    server of the root namespace (loopback in the fallback)."""
    return host.address if host.netns is None else host.address.rsplit(".", 1)[0] + ".1"


def cut_off(host: TestHost) -> None:
    """The host's link goes down: nothing reaches it and it reaches nothing (its processes live on)."""
    if host.netns is None:
        raise RuntimeError("a loopback test host cannot be cut off")
    _ip("-n", host.netns, "link", "set", "eth0", "down")


@contextlib.contextmanager
def engine_on(
    host: TestHost, folder: str, engine_id: str, token: str, *extra: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """A rollout engine server process on ``host`` (one torch thread), listening on the host's
    address, serving ``folder``; its URL. ``extra``: more of the server's command-line options;
    ``env``: more environment (S3 credentials and endpoint, say)."""
    port = free_port()
    command = [sys.executable, "-m", "engines.rollout.server", "--model", folder, "--port", str(port)]
    command += ["--host", host.address, "--engine-id", engine_id, "--admin-token", token, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    url = f"http://{host.address}:{port}"
    with serving_process(host.command(command), url, env):  # `ip netns exec` execs: the same process
        yield url
