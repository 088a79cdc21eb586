"""Shared fixtures: a real Prefect test harness (one per session: each costs seconds), a real S3 API
server on loopback (moto's ThreadedMotoServer), temporary stores, the CLI's environment kept inside a
test (cli_env), torch on one thread for a module (one_thread), and a listening loopback port
(listening_port)."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from bench.servers import environ
from engines.net import free_port

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 API server on 127.0.0.1 (not a mocked client): s3fs and boto3 talk HTTP to it."""
    from moto.server import ThreadedMotoServer

    # the server's per-request log lines would land in whatever stream a test captures
    for name in ("werkzeug", "moto"):
        logging.getLogger(name).setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    credentials = dict(
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
    )
    try:
        with environ(credentials):
            yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, request):
    """A fresh bucket on the loopback S3 server; returns (endpoint, bucket name)."""
    import boto3

    name = "gyre-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return s3_server, name


@pytest.fixture
def store_config(tmp_path):
    from trajectory_store.storage import StoreConfig

    return StoreConfig(data_root=str(tmp_path / "data"), campaign="test")


@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    """The CLI reads defaults from the environment and sets PREFECT_HOME: keep both inside the test."""
    monkeypatch.delenv("GYRE_DATA_ROOT", raising=False)
    monkeypatch.delenv("GYRE_CAMPAIGN", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))


@pytest.fixture(scope="module")
def one_thread():
    """torch on one CPU thread for a module's tests: a 32-wide model is fastest single-threaded (on a
    busy 2-core host, two threads spin), and with one thread here and in every satellite a
    micro-batch's gradient is bitwise the same wherever it is computed."""
    from tests.test_rollout_fixtures import one_cpu_thread

    with one_cpu_thread():
        yield


@pytest.fixture
def listening_port():
    """A listening loopback socket's port, standing for another service of the host (the Prefect API, S3)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]
