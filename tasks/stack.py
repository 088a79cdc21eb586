"""A local serving stack on loopback: rollout engine processes and the gateway in front of them.

Benchmarks, `gyre model sft` (its before/after evaluation) and `gyre rollout --model` start one for
the duration of a command; `gyre engine` / `gyre gateway` are the long-running equivalents.

    with local_stack("./models/tiny", StoreConfig(data_root="./gyre-data")) as stack:
        dispatch(problems, stack.gateway_url, stack.admin_token, stack.store, ...)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from trajectory_store.storage import StoreConfig


@dataclass
class LocalStack:
    gateway_url: str
    admin_token: str
    engine_urls: list[str]
    engine_admin_token: str
    store: StoreConfig


@contextlib.contextmanager
def local_stack(
    model_dir: str,
    store: StoreConfig,
    *,
    engines: int = 1,
    threads: int = 1,
    max_batch_size: int = 8,
    step: int = 0,
) -> Iterator[LocalStack]:
    """Starts ``engines`` engine processes (``threads`` torch threads each) and the gateway."""
    admin_token, engine_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with contextlib.ExitStack() as stack:
        engine_urls = []
        for index in range(engines):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            command = [sys.executable, "-m", "engines.rollout.server", "--model", model_dir]
            command += ["--port", str(port), "--admin-token", engine_token, "--engine-id", f"local-{index}"]
            command += ["--max-batch-size", str(max_batch_size)]
            stack.enter_context(serving_process(command, url, env))
            engine_urls.append(url)
        port = free_port()
        gateway_url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "engines.gateway", "--model", model_dir, "--port", str(port)]
        for url in engine_urls:
            command += ["--engine", url]
        command += ["--admin-token", admin_token, "--engine-admin-token", engine_token]
        command += ["--data-root", store.data_root, "--campaign", store.campaign, "--step", str(step)]
        if store.s3_endpoint_url:
            env = {**env, "AWS_ENDPOINT_URL": store.s3_endpoint_url}
        stack.enter_context(serving_process(command, gateway_url, env))
        yield LocalStack(gateway_url, admin_token, engine_urls, engine_token, store)


@contextlib.contextmanager
def serving_process(command: list[str], url: str, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """Runs a server process until the block ends; waits for its /health (its log is shown if it dies)."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"{' '.join(command[:3])} exited with {process.returncode}: {tail}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(command[:3])} did not start within 180 s")
                time.sleep(0.2)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
