"""A minimal HTTP/1.1 keep-alive client over asyncio streams, for the gateway's hot path (generation).

    client = KeepAliveClient("http://127.0.0.1:8100", connect_timeout_s=5)
    status, body = await client.request("POST", "/v1/completions", json_bytes, {"content-type": ...})

Why not httpx here: on the hot path httpx (httpcore + anyio) costs ~1 ms of Python per request and
writes headers and body as two sends; this client writes each request in ONE send and parses the
reply directly, which took the gateway's per-call overhead from ~5.4 to ~3.2 ms (p50, bench/engine.py,
on a 2-core host). Admin calls (KV export/import, stats) keep using httpx.

Scope: plain http:// only; responses framed by Content-Length or chunked transfer encoding; one
request per connection at a time, idle connections kept for reuse (at most ``max_idle``). A pooled
connection the server already closed (keep-alive timeout) is detected before reuse (EOF seen) and,
for the race where it closes just as we send, a request on a REUSED connection that gets no byte of
answer is sent once more on a fresh connection (the server closed it without reading it). Any other
failure raises ConnectionError / OSError / asyncio.IncompleteReadError, or TimeoutError.
"""

from __future__ import annotations

import asyncio
import urllib.parse


class KeepAliveClient:
    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 5.0,
        timeout_s: float | None = None,
        max_idle: int = 256,
    ):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"KeepAliveClient speaks plain http only, not {url!r}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self.max_idle = max_idle
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._busy: set[asyncio.StreamWriter] = set()  # connections with a request in flight
        self._aborted: str | None = None
        self._host_header = f"{self.host}:{self.port}"

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\nhost: {self._host_header}\r\n"
        head += f"content-length: {len(body)}\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        payload = head.encode("latin-1") + b"\r\n" + body
        if self._aborted is not None:
            raise ConnectionAbortedError(self._aborted)
        connection, reused = self._take()
        if connection is None:
            connection = await self._connect()
        try:
            return await self._exchange(connection, payload)
        except _ClosedBeforeAnswer:
            if self._aborted is not None:
                raise ConnectionAbortedError(self._aborted) from None
            if not reused:
                raise ConnectionResetError("the server closed the connection without answering") from None
            return await self._exchange(await self._connect(), payload)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    def abort(self, reason: str) -> None:
        """Ends every request in flight now (ConnectionAbortedError) and refuses new ones: for a
        server that stopped answering without closing its connections (a host cut off from the
        network, a frozen process), where a read would otherwise wait forever."""
        self._aborted = reason
        for writer in list(self._busy):
            writer.transport.abort()
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.transport.abort()

    def _take(self) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None, bool]:
        while self._idle:
            reader, writer = self._idle.pop()
            if reader.at_eof() or writer.is_closing():
                writer.close()
                continue
            return (reader, writer), True
        return None, False

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.wait_for(asyncio.open_connection(self.host, self.port), self.connect_timeout_s)

    async def _exchange(
        self, connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], payload: bytes
    ) -> tuple[int, bytes]:
        reader, writer = connection
        done = False
        self._busy.add(writer)
        try:
            writer.write(payload)
            if self.timeout_s is None:
                status, body, keep = await self._read(reader)
            else:
                status, body, keep = await asyncio.wait_for(self._read(reader), self.timeout_s)
            done = keep
            return status, body
        except (OSError, asyncio.IncompleteReadError):
            if self._aborted is not None:
                raise ConnectionAbortedError(self._aborted) from None
            raise
        finally:
            self._busy.discard(writer)
            if done and self._aborted is None and len(self._idle) < self.max_idle:
                self._idle.append(connection)
            else:
                writer.close()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
        status_line = await reader.readline()
        if not status_line:
            raise _ClosedBeforeAnswer
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ConnectionError(f"not an HTTP/1.x response: {status_line[:80]!r}")
        status = int(parts[1])
        length, chunked, keep = None, False, parts[0] == b"HTTP/1.1"
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise asyncio.IncompleteReadError(b"", None)
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value
            elif name == "connection":
                keep = value != "close" if keep else value == "keep-alive"
        if chunked:
            body = bytearray()
            while True:
                size = int((await reader.readline()).split(b";")[0].strip(), 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                body += await reader.readexactly(size)
                await reader.readexactly(2)
            return status, bytes(body), keep
        if length is None:  # framed by the connection's end
            return status, await reader.read(), False
        return status, await reader.readexactly(length), keep


class _ClosedBeforeAnswer(ConnectionError):
    """The connection ended before the first byte of a response."""
