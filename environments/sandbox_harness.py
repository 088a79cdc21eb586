"""An external harness confined to its execution's sandbox, with one way out: a relay to the gateway.

    url = relayed_url(sandbox, registration["base_url"])          # the base_url to hand the harness
    harness = await ConfinedHarness.start(sandbox, argv, env, log_path, registration["base_url"],
                                          limits, visible=harness_files(argv, env) + [side_folder])
    returncode = await harness.wait()
    await harness.close()               # kills what is left, stops the relay, removes the cgroup

The harness process itself starts through the sandbox's launcher (environments/sandbox_launcher.py),
as a tool command of the built-in harness does, so it and everything it spawns share one confinement:
its workspace read-write, the system read-only, gyre's checkout and packages and the other workspaces
hidden, a private /tmp (its HOME), a pids cgroup, rlimits, no capabilities, a network namespace of its
own. What it sees of its own installation, read-only: the interpreter gyre runs on, the program of its
command (with the virtualenv it belongs to and that venv's base Python), every file its command names
(its script), and the folders of DispatchConfig.harness_paths.

The network: the launcher makes a TCP listener on 127.0.0.1:<the gateway's port> inside the new
namespace and hands its fd back over a Unix socketpair (SCM_RIGHTS) before anything of the harness
runs; ``ConfinedHarness`` accepts on it from the host's namespace and relays each connection, byte for
byte, to the gateway's address. So ``http://127.0.0.1:<port>/x/<execution>/v1`` (``relayed_url``)
reaches the gateway, and no other port or address answers: the Prefect API, the S3 server and every
other loopback service of the host are out of reach of the harness and its commands. The relay is a
plain TCP pipe (environments/relay.py: with several gateways it fails over to the execution's next
one): the gateway's admin API stays behind its admin token, which the harness never gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from environments.relay import Relays, Upstreams, gateway_address
from environments.sandbox import Sandbox, SandboxLimits
from environments.sandbox_host import close_cgroup, kill_group, launcher_argv, make_cgroup
from environments.sandbox_launcher import SETUP_EXIT, SETUP_FAILED

log = logging.getLogger(__name__)


def relayed_url(sandbox: Sandbox, url: str) -> str:
    """The base_url a confined harness uses: the relay on its own loopback (same port, same path);
    ``url`` itself where the sandbox has no network namespace (then nothing is relayed)."""
    if not sandbox.network_isolated:
        return url
    parts = urlsplit(url)
    _, port = gateway_address(url)
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))


def harness_files(argv: list[str], env: dict[str, str], extra: Sequence[str] = ()) -> list[str]:
    """What of its own installation a harness sees read-only: its program (found on ``env``'s PATH),
    every existing file a word of ``argv`` names (or a word of a ``bash -c`` script), the interpreter
    each of them names in its ``#!`` line, the virtualenvs all these live in with their base Python,
    and the folders ``extra`` (DispatchConfig.harness_paths)."""
    program = shutil.which(argv[0], path=env.get("PATH")) if argv else None
    files = [
        path for path in [program, *_words(argv[1:])] if path and os.path.isabs(path) and os.path.isfile(path)
    ]
    files += [
        interpreter for path in files if (interpreter := _shebang(path)) and os.path.isfile(interpreter)
    ]
    found: set[str] = set()
    for path in files:
        found |= {os.path.abspath(path), os.path.realpath(path), *_venv(path)}
    for folder in extra:
        if not os.path.exists(folder):
            raise FileNotFoundError(f"harness_paths names {folder!r}, which does not exist")
        found |= {os.path.abspath(folder), os.path.realpath(folder)}
    return sorted(found)


def _words(argv: list[str]) -> list[str]:
    """The words of ``argv``, and the words of those that are shell scripts (``bash -c '...'``)."""
    words = []
    for word in argv:
        words.append(word)
        if any(space in word for space in " \t\n"):
            try:
                words += shlex.split(word)
            except ValueError:  # unbalanced quotes: its plain words will do
                words += word.split()
    return words


def _shebang(program: str | None) -> str | None:
    with contextlib.suppress(OSError, TypeError):
        with open(program, "rb") as script:
            first = script.readline(256)
        if first.startswith(b"#!"):
            words = first[2:].decode(errors="replace").split()
            return words[0] if words else None
    return None


def _venv(path: str) -> set[str]:
    """The virtualenv ``path`` lives in (``<venv>/bin/<path>`` with ``<venv>/pyvenv.cfg``) and its
    base installation (the folder above pyvenv.cfg's ``home``); empty when it lives in none."""
    found = set()
    for candidate in {os.path.abspath(path), os.path.realpath(path)}:
        venv = Path(candidate).parent.parent
        config = venv / "pyvenv.cfg"
        if not config.is_file():
            continue
        found |= {str(venv), os.path.realpath(venv)}
        for line in config.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                found.add(os.path.realpath(Path(value.strip()).parent))
    return found


class ConfinedHarness:
    """One harness process in its sandbox (pid: the launcher's, leader of its process group) and the
    relay that is its way to the gateway."""

    def __init__(self, process: asyncio.subprocess.Process, cgroup: str | None, log_path: str):
        self.process = process
        self.pid = process.pid
        self.cgroup = cgroup
        self.log_path = log_path
        self.server: asyncio.Server | None = None
        self.relays: Relays | None = None

    @classmethod
    async def start(
        cls,
        sandbox: Sandbox,
        argv: list[str],
        env: dict[str, str],
        log_path: str | Path,
        gateway_url: str,
        limits: SandboxLimits,
        visible: list[str],
        fallback_urls: Sequence[str] = (),
    ) -> ConfinedHarness:
        """``gateway_url``: the execution's gateway (its port is the one the harness dials);
        ``fallback_urls``: the gateways its calls go to, in order, once that one is gone
        (environments/relay.py)."""
        program = shutil.which(argv[0], path=env.get("PATH"))
        if program is None:
            raise FileNotFoundError(f"harness program {argv[0]!r} not found on PATH {env.get('PATH')!r}")
        spec = sandbox.spec([os.path.abspath(program), *argv[1:]], env, limits, visible)
        ours, theirs = socket.socketpair() if sandbox.network_isolated else (None, None)
        if theirs is not None:
            spec["listen"] = {"port": gateway_address(gateway_url)[1], "fd": theirs.fileno()}
        spec["cgroup"] = cgroup = make_cgroup(sandbox.pids_cgroup, limits.processes)
        try:
            with open(log_path, "wb") as log_file:
                process = await asyncio.create_subprocess_exec(
                    *launcher_argv(spec),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    cwd=sandbox.workspace,
                    env={},
                    start_new_session=True,
                    pass_fds=() if theirs is None else (theirs.fileno(),),
                )
        except BaseException:
            close_cgroup(cgroup)
            if ours is not None:
                ours.close()
            raise
        finally:
            if theirs is not None:
                theirs.close()
        harness = cls(process, cgroup, str(log_path))
        if ours is None:
            return harness
        try:
            with ours:
                listener = await asyncio.to_thread(_receive_listener, ours)
            if listener is not None:  # None: the launcher failed before (its exit says why)
                upstreams = Upstreams([gateway_address(url) for url in [gateway_url, *fallback_urls]])
                harness.relays = Relays(upstreams)
                harness.server = await asyncio.start_server(harness.relays.handle, sock=listener)
        except BaseException:
            await harness.close()
            raise
        return harness

    async def wait(self) -> int:
        return await self.process.wait()

    def setup_error(self) -> str | None:
        """The launcher's own error when the harness never started (the sandbox could not be built)."""
        if self.process.returncode != SETUP_EXIT:
            return None
        with contextlib.suppress(OSError):
            for line in Path(self.log_path).read_text(errors="replace").splitlines():
                if line.startswith(SETUP_FAILED):
                    return line
        return None

    async def close(self) -> None:
        """Kills whatever is left of the harness, stops its relay, removes its cgroup."""
        kill_group(self.pid)
        await self.process.wait()
        if self.server is not None:
            self.server.close()
        if self.relays is not None:
            await self.relays.close()
        close_cgroup(self.cgroup)


def _receive_listener(channel: socket.socket) -> socket.socket | None:
    channel.settimeout(60)
    with contextlib.suppress(OSError):
        _, fds, _, _ = socket.recv_fds(channel, 16, 1)
        if fds:
            return socket.socket(fileno=fds[0])
    return None
