"""engines/gateway/http.py's KeepAliveClient against small asyncio servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from engines.gateway.http import KeepAliveClient


@contextlib.asynccontextmanager
async def server(handle):
    """An HTTP-ish server on a loopback port; ``handle(reader, writer, state)`` serves one connection."""
    state = {"connections": 0, "requests": 0}

    async def on_connect(reader, writer):
        state["connections"] += 1
        try:
            await handle(reader, writer, state)
        finally:
            writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        listener.close()
        await listener.wait_closed()


async def read_request(reader) -> bytes | None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return await reader.readexactly(length)


def reply(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body


async def echo_forever(reader, writer, state):
    while True:
        try:
            body = await read_request(reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        state["requests"] += 1
        writer.write(reply(body))
        await writer.drain()


def test_requests_reuse_one_connection_and_send_the_body_whole():
    async def main():
        async with server(echo_forever) as (url, state):
            client = KeepAliveClient(url)
            for i in range(5):
                assert await client.request("POST", "/x", f"body {i}".encode()) == (200, f"body {i}".encode())
            await client.close()
            return state

    state = asyncio.run(main())
    assert state == {"connections": 1, "requests": 5}


def test_a_connection_the_server_closed_while_idle_is_replaced():
    async def one_request_then_close(reader, writer, state):
        body = await read_request(reader)
        state["requests"] += 1
        writer.write(reply(body))
        await writer.drain()  # then the connection closes (keep-alive timeout)

    async def main():
        async with server(one_request_then_close) as (url, state):
            client = KeepAliveClient(url)
            assert (await client.request("POST", "/x", b"a"))[1] == b"a"
            await asyncio.sleep(0.05)  # the FIN arrives: the pooled connection is at EOF
            assert (await client.request("POST", "/x", b"b"))[1] == b"b"
            return state

    assert asyncio.run(main())["connections"] == 2


def test_a_reused_connection_closed_before_answering_is_retried_once_fresh():
    async def flaky(reader, writer, state):
        if state["connections"] == 1:
            body = await read_request(reader)
            writer.write(reply(body))
            await writer.drain()
            await read_request(reader)  # the second request on this connection: closed unanswered
            return
        await echo_forever(reader, writer, state)

    async def main():
        async with server(flaky) as (url, state):
            client = KeepAliveClient(url)
            await client.request("POST", "/x", b"first")
            assert await client.request("POST", "/x", b"second") == (200, b"second")
            return state

    assert asyncio.run(main())["connections"] == 2


def test_a_fresh_connection_closed_before_answering_is_an_error():
    async def rude(reader, writer, state):
        await read_request(reader)

    async def main():
        async with server(rude) as (url, _):
            with pytest.raises(ConnectionError):
                await KeepAliveClient(url).request("POST", "/x", b"q")

    asyncio.run(main())


def test_chunked_bodies_and_connection_close_are_understood():
    async def chunked(reader, writer, state):
        await read_request(reader)
        writer.write(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        writer.write(b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n")
        await writer.drain()

    async def main():
        async with server(chunked) as (url, _):
            client = KeepAliveClient(url)
            answer = await client.request("GET", "/x")
            return answer, len(client._idle)

    assert asyncio.run(main()) == ((201, b"hello world"), 0)


def test_nobody_listening_raises_oserror():
    async def main():
        async with server(echo_forever) as (url, _):
            pass  # closed again: the port refuses
        with pytest.raises(OSError):
            await KeepAliveClient(url, connect_timeout_s=2).request("GET", "/x")

    asyncio.run(main())
