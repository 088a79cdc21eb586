"""A free TCP port on loopback, for a server this process is about to start (an engine, the gateway,
a trainer's rendezvous). Defined once here, the lowest layer that starts servers; everything above
imports it.

    port = free_port()

The port is free when asked; another process may take it before the server binds it, which on a
test machine is rare enough that callers simply start the server on it.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
