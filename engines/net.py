"""Networking helpers shared by every layer above (servers, the trainer's rendezvous, the gateway, tests)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

KEEP_ALIVE_S = 75
"""How long our HTTP servers keep an idle connection open. uvicorn's default (5 s) equals httpx's client
keep-alive (5 s): a client that reuses a connection at the moment the server closes it gets
httpx.ReadError (or "server disconnected") on a request the server never read. Longer on the server side,
the client always lets go first."""


def serve_http(app: Any, host: str, port: int) -> None:
    """Runs ``app`` under uvicorn until it is stopped, as every gyrerl server does (KEEP_ALIVE_S)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick); a server started soon after gets it."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def host_of(url: str) -> str:
    """The host a server's URL names, lower case; every loopback name and address is "loopback"."""
    name = (urlsplit(url).hostname or "").lower()
    if name == "localhost":
        return "loopback"
    try:
        return "loopback" if ipaddress.ip_address(name).is_loopback else name
    except ValueError:  # a host name
        return name
