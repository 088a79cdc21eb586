"""Networking helpers shared by every layer above (servers, the trainer's rendezvous, the gateway, tests)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


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
