"""A real `prefect server start` for the tests that need one of their own (a worker, hosts in network
namespaces): SQLite in a temporary PREFECT_HOME, on the address given (loopback by default)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from engines.net import free_port


@contextlib.contextmanager
def prefect_server(home: Path, host: str = "127.0.0.1") -> Iterator[tuple[str, dict[str, str]]]:
    """(its API URL, the environment its clients and workers need) while the block runs."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port(host)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    prefect = str(Path(sys.executable).parent / "prefect")
    with open(home / "server.log", "wb") as log:
        server = subprocess.Popen(
            [prefect, "server", "start", "--host", host, "--port", str(port), "--analytics-off"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://{host}:{port}/api"
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(
                    f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)
        try:
            yield url, {**env, "PREFECT_API_URL": url}
        finally:
            server.terminate()
            server.wait(timeout=30)
