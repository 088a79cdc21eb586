"""Loopback networking helpers shared by every layer above (servers, the trainer's rendezvous, tests)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick); a server started soon after gets it."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
