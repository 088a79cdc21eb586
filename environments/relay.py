"""A byte-for-byte TCP relay from a harness to its execution's gateways, with failover.

    upstreams = Upstreams([("10.0.0.1", 8000), ("10.0.0.2", 8000)])   # the execution's gateways, in order
    relay = await LoopbackRelay.start(upstreams)
    base_url = relay.url(registration["base_url"])     # http://127.0.0.1:<relay port>/x/<execution>/v1
    ...
    await relay.close()

Every connection the harness opens is piped to the current gateway. When that gateway refuses a
connection (its process died) or does not accept one within ``connect_timeout_s`` (its host is cut
off), the next one becomes current, for good: a gateway restarted on the same address never takes the
execution back (it does not know it). A request in flight when its gateway dies ends with a broken
connection; the harness's client retries it (the built-in harness does) and the retry reaches the next
gateway. The path (``/x/<execution>/v1/...``) and the key are the same on every gateway the execution is
registered at (environments/gateways.py), so the harness never learns which one answers.

A confined harness's relay (environments/sandbox_harness.py) pipes the same way from the listener inside
its network namespace; an unconfined harness with more than one gateway gets a LoopbackRelay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)
RELAY_CHUNK = 1 << 16
CONNECT_TIMEOUT_S = 3.0


class Upstreams:
    """The addresses a relay reaches, in order, and which one is current (``current``: its index)."""

    def __init__(self, addresses: Sequence[tuple[str, int]], connect_timeout_s: float = CONNECT_TIMEOUT_S):
        if not addresses:
            raise ValueError("a relay needs at least one gateway address")
        self.addresses = list(addresses)
        self.connect_timeout_s = connect_timeout_s
        self.current = 0

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the current address; on failure the next one becomes current (the last
        one's error is raised)."""
        while True:
            index = self.current
            host, port = self.addresses[index]
            try:
                return await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout_s)
            except (OSError, TimeoutError) as exc:
                if index + 1 >= len(self.addresses):
                    raise
                if self.current == index:  # another connection may have moved on already
                    self.current = index + 1
                    log.warning(
                        "gateway %s:%d did not take a connection (%s): the execution goes on at %s:%d",
                        host,
                        port,
                        exc or type(exc).__name__,
                        *self.addresses[self.current],
                    )


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstreams: Upstreams) -> None:
    """Pipes one accepted connection to the current upstream until either side ends."""
    upstream, pipes = None, []
    try:
        up_reader, upstream = await upstreams.connect()
        pipes = [
            asyncio.ensure_future(_pipe(reader, upstream)),
            asyncio.ensure_future(_pipe(up_reader, writer)),
        ]
        await asyncio.gather(*pipes)
    except OSError as exc:
        log.debug("relay to the gateway ended: %s", exc)
    except TimeoutError:
        log.debug("relay: no gateway took the connection")
    finally:
        for pipe in pipes:  # one side failed (or the harness ended): the other goes too
            pipe.cancel()
        for stream in (writer, upstream):
            if stream is not None:
                stream.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copies until ``source`` ends, then half-closes ``sink`` (HTTP needs no more)."""
    while data := await source.read(RELAY_CHUNK):
        sink.write(data)
        await sink.drain()
    with contextlib.suppress(OSError):
        if sink.can_write_eof():
            sink.write_eof()


class Relays:
    """The relay tasks of one listener, so closing it ends every connection it piped."""

    def __init__(self, upstreams: Upstreams):
        self.upstreams = upstreams
        self.tasks: set[asyncio.Task] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            await relay(reader, writer, self.upstreams)
        finally:
            self.tasks.discard(task)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class LoopbackRelay:
    """A relay listening on a free port of 127.0.0.1 (``port``), for a harness that is not confined."""

    def __init__(self, server: asyncio.Server, relays: Relays):
        self.server, self.relays = server, relays
        self.port: int = server.sockets[0].getsockname()[1]

    @classmethod
    async def start(cls, upstreams: Upstreams) -> LoopbackRelay:
        relays = Relays(upstreams)
        server = await asyncio.start_server(relays.handle, "127.0.0.1", 0)
        return cls(server, relays)

    def url(self, base_url: str) -> str:
        """``base_url`` (a gateway's) with the relay as its host: same path."""
        return urlunsplit(urlsplit(base_url)._replace(netloc=f"127.0.0.1:{self.port}"))

    async def close(self) -> None:
        self.server.close()
        await self.relays.close()


def gateway_address(url: str) -> tuple[str, int]:
    """(host, port) of a gateway base_url."""
    parts = urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"gateway url {url!r} names no host")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
