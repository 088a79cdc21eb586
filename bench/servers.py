"""Servers a benchmark or a test starts for itself, on an address it names (the root namespace's on
the test hosts' network, loopback by default).

    with prefect_server(home, host) as (api_url, env): ...   # `prefect server start`, SQLite under home
    with s3_server(host) as (bucket, env): ...              # a moto S3 server, this process's S3 env set
"""

from __future__ import annotations

import contextlib
import logging
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
            # this process's events still queued for the server (task and flow run states) go now:
            # left for the interpreter's exit, they wait on a server that is gone
            from prefect.events.worker import EventsWorker

            with contextlib.suppress(Exception):
                EventsWorker.drain_all(timeout=30, at_exit=False)
            server.terminate()
            server.wait(timeout=30)


@contextlib.contextmanager
def s3_server(host: str = "127.0.0.1") -> Iterator[tuple[str, dict[str, str]]]:
    """A moto S3 server on ``host`` and a new bucket of its own; while the block runs, this process's
    environment has the credentials and endpoint (so has every process it starts). (bucket, that
    environment's S3 part, for processes started elsewhere)."""
    import boto3
    from moto.server import ThreadedMotoServer

    for name in ("werkzeug", "moto"):  # the server's per-request lines
        logging.getLogger(name).setLevel(logging.ERROR)
    port = free_port(host)
    server = ThreadedMotoServer(ip_address=host, port=port)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    try:
        with environ(env):
            # a bucket of its own: moto keeps one store per process, which another server of it may have filled
            bucket = f"gyre-{os.getpid()}-{time.monotonic_ns()}"
            boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
            yield bucket, env
    finally:
        server.stop()


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs, the old ones back after (s3fs's
    cached clients, which read it, are dropped on both sides)."""
    import s3fs

    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()
