"""A local serving stack on loopback: rollout engine processes and the gateway in front of them.

Benchmarks, `gyre model sft` (its before/after evaluation) and `gyre rollout --model` start one for
the duration of a command; `gyre engine` / `gyre gateway` are the long-running equivalents.

    with local_stack("./models/tiny", StoreConfig(data_root="./gyre-data")) as stack:
        dispatch(problems, stack.gateway_url, stack.admin_token, stack.store, ...)

With ``partition="cgroup"`` (``[serving] partition``) each engine's cell gets a CPU cgroup with its
share as quota (engines/devices/cpu_quota.py) for the duration of the block: ``stack.cells`` are the
cells with their cgroups, for the processes the cell starts later (its replica, the core trainer),
and ``stack.partition`` reads each cell's CPU use. The gateway belongs to no cell.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import httpx

from engines.devices import CellDevices, process_env
from engines.devices.cpu_quota import CpuPartition, cpu_partition
from engines.gateway.config import EngineSpec, GatewayConfig
from engines.net import free_port
from stack.serving import engine_process
from stack.up import ServingConfig
from trajectory_store.storage import StoreConfig


@dataclass
class LocalStack:
    gateway_url: str  # the first gateway's
    admin_token: str
    engine_urls: list[str]
    engine_admin_token: str
    store: StoreConfig
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    """The server processes by URL (the engines' and the gateway's): fault tests kill them."""
    gateway_config: str = ""
    """The gateway's config as JSON (what its stdin got): a fault test starts it again with it."""
    cells: list[CellDevices] = field(default_factory=list)
    """Each engine's cell (cell i: engine i), with its CPU cgroup when partitioned: what the cell's
    other processes (its trainer replica, the core trainer for cell 0) are started with."""
    partition: CpuPartition = field(default_factory=CpuPartition.none)
    """The cells' CPU cgroups (``partitioned`` False: none, the cells share the cores)."""
    gateway_urls: list[str] = field(default_factory=list)
    """Every gateway (``gateways`` > 1), the first being gateway_url; [] with one."""
    restart: Callable[[str], subprocess.Popen] | None = None
    """Starts the gateway at this URL again (same port, config and spool) once its process died, for
    the duration of the stack; returns the new process (also put in ``processes``)."""


@contextlib.contextmanager
def local_stack(
    model_dir: str,
    store: StoreConfig,
    *,
    engines: int = 1,
    threads: int = 1,
    max_batch_size: int = 8,
    step: int = 0,
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
    cells: list[CellDevices] | None = None,
    engine: Literal["gyre", "vllm"] = "gyre",
    vllm_python: str | None = None,
    serving: ServingConfig | None = None,
    partition: Literal["none", "cgroup"] | None = None,
    gateway_host: str = "127.0.0.1",
    gateways: int = 1,
) -> Iterator[LocalStack]:
    """Starts ``engines`` engine processes (``threads`` torch threads each) and the gateway. Each gets
    its typed config as JSON on stdin (``--config -``): admin tokens never appear in argv or on disk.
    ``cells``: what each engine's process gets (its GPUs, threads and cores: ServingConfig.engine_cell),
    one per engine, in place of ``threads``. ``engine``: 'gyre' or 'vllm' (stack/serving.py);
    ``serving``: a campaign's whole [serving] (its engine kind and vLLM options) in place of
    max_batch_size, dtype, engine and vllm_python. ``partition``: 'cgroup' gives each cell its CPU share
    as a cgroup quota (None: ``serving``'s, else 'none'). ``gateway_host``: where the gateway listens
    (an address other hosts reach, for engines there: stack/fleet.py); ``gateways``: how many
    gateway processes, each on a port of its own with the same engines and store
    (environments/gateways.py spreads executions over them)."""
    admin_token, engine_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    env = {**os.environ, **process_env(CellDevices(threads=threads))}
    if cells is not None and len(cells) != engines:
        raise ValueError(f"{len(cells)} cells for {engines} engines: one cell per engine")
    cells = cells or [CellDevices(threads=threads) for _ in range(engines)]
    with contextlib.ExitStack() as stack:
        engine_urls, processes = [], {}
        serving = serving or ServingConfig(
            max_batch_size=max_batch_size, engine_dtype=dtype, engine=engine, vllm_python=vllm_python
        )
        quota = CpuPartition.none()
        if (partition or serving.partition) == "cgroup":  # removed last: after every process stopped
            quota = stack.enter_context(
                cpu_partition(f"stack-{secrets.token_hex(4)}", cells, host_cores=serving.host_cores)
            )
            cells = quota.place(cells)
        for index in range(engines):
            engine_env = {**os.environ, **process_env(cells[index])}
            port = free_port()
            command, stdin, _ = engine_process(model_dir, serving, port, engine_token)
            url = f"http://127.0.0.1:{port}"
            processes[url] = stack.enter_context(serving_process(command, url, engine_env, stdin=stdin))
            engine_urls.append(url)
        command = [sys.executable, "-m", "engines.gateway", "--config", "-"]
        configs = []
        for _ in range(gateways):
            gateway = GatewayConfig(
                model=model_dir,
                host=gateway_host,
                port=free_port(gateway_host),
                engines=[EngineSpec(url=url) for url in engine_urls],
                admin_token=admin_token,
                engine_admin_token=engine_token,
                store=store,
                step=step,
            )
            processes[gateway.base_url()] = stack.enter_context(
                serving_process(command, gateway.base_url(), env, stdin=gateway.model_dump_json())
            )
            configs.append(gateway)
        by_url = {c.base_url(): c for c in configs}

        def restart(url: str) -> subprocess.Popen:
            config = by_url[url]
            process = stack.enter_context(serving_process(command, url, env, stdin=config.model_dump_json()))
            processes[url] = process
            return process

        gateway = configs[0]
        yield LocalStack(
            gateway.base_url(),
            admin_token,
            engine_urls,
            engine_token,
            store,
            processes,
            gateway.model_dump_json(),
            cells,
            quota,
            [c.base_url() for c in configs] if gateways > 1 else [],
            restart,
        )


def log_tail(text: str, chars: int = 2000) -> str:
    """The end of a dead server's log without the lines nanobind prints at exit about objects it
    leaked (Triton's, hundreds of them under vLLM), which would push the error out of the tail."""
    kept = [
        line
        for line in text.splitlines()
        if not line.startswith("nanobind: leaked") and not line.lstrip().startswith("- leaked ")
    ]
    return "\n".join(kept)[-chars:]


@contextlib.contextmanager
def serving_process(
    command: list[str], url: str, env: dict[str, str], *, stdin: str | None = None
) -> Iterator[subprocess.Popen]:
    """Runs a server process until the block ends; waits for its /health (its log is shown if it dies).
    ``stdin``: written to the process's standard input, which is then closed (a config as JSON)."""
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
        )
        with process.stdin:  # type: ignore[union-attr]
            process.stdin.write((stdin or "").encode())  # type: ignore[union-attr]
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    tail = log_tail(log.read().decode(errors="replace"))
                    raise RuntimeError(f"{' '.join(command[:3])} exited with {process.returncode}: {tail}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{' '.join(command[:3])} did not start within 300 s")
                time.sleep(0.2)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
