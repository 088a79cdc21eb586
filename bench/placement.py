"""Placing cells on hosts: Prefect work pools (what gyrerl uses) against prefect-ray (Ray places the
cells, Prefect runs the flow), on the same topology, measured: what `gyre bench hosts` reports under
`placement`.

    figures = compare_placement(workdir)

Each way places three cells (an engine of the tiny policy each) on three test hosts (bench/netns.py,
fresh namespaces for each way) behind one gateway on the campaign machine, then cuts h3 off and waits
until its cell serves again on another host.

- work pools (stack/fleet.py CellFleet): one process worker a host, each cell a flow run
  of `gyre-cell/<host>`; a host is lost once its worker misses 3 heartbeats of 2 s and its engines do
  not answer; the cell starts again on the live host with the fewest cells.
- prefect-ray: a Ray head on the campaign machine (no CPU, so nothing runs there), one Ray node a
  host (`ray start --address`) with `cell` slots; a flow on prefect-ray's RayTaskRunner submits one
  task a cell (`ray_cell`), which Ray places on a node with a free slot (SPREAD); a node is dead once
  it misses 3 health checks of 1 s (RAY_health_check_*, Ray's defaults are 3 s and 5), and Ray runs
  the dead node's task again on a live one (`max_retries`).

The figures of each way: ``placement_s`` (from the request to every cell serving), ``found_lost_s``
and ``recovery_s`` after the cut (the host found lost; its cell serving elsewhere), per host the
resident memory and processes of what the way runs there besides the engine (the Prefect worker; the
raylet, its workers and agents), and what a user runs on each host.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.netns import TestHost, cut_off, hosts, root_address
from bench.servers import prefect_server
from engines.admin import AdminClient

CELLS = 3
STOP_VARIABLE = "gyre-ray-cells"  # the Ray cells serve while this Prefect variable says "serve"
HEARTBEAT_S = 2
REPLACE_TIMEOUT_S = 180.0  # how long a way may take to serve a lost host's cells elsewhere


def compare_placement(workdir: Path) -> dict[str, Any]:
    """Both ways on the same topology; the figures of each (see the module's docstring)."""
    from engines.model import ModelConfig, init_model

    policy = str(workdir / "policy")
    init_model(ModelConfig(preset="tiny", seed=0), policy)
    out: dict[str, Any] = {}
    for way, run in (("work_pools", _work_pools), ("prefect_ray", _prefect_ray)):
        with hosts([f"h{i + 1}" for i in range(CELLS)]) as test_hosts:
            if test_hosts[0].netns is None:
                raise RuntimeError("placement is compared on network namespaces (this machine gives none)")
            try:
                out[way] = run(workdir / way, test_hosts, policy)
            finally:
                for host in test_hosts:
                    _kill_all(host)
        print(_line(way, out[way]), flush=True)
    pools, ray = out["work_pools"], out["prefect_ray"]
    out["ray_over_pools"] = {
        key: round(ray[key] / pools[key], 3)
        for key in ("placement_s", "found_lost_s", "recovery_s", "agent_rss_mb_per_host")
        if pools.get(key) and ray.get(key) is not None
    }
    return out


def _line(way: str, row: dict[str, Any]) -> str:
    again = (
        f"{row['recovery_s']} s" if row["recovery_s"] is not None else f"not within {REPLACE_TIMEOUT_S:g} s"
    )
    return (
        f"placement   {way:<12} cells serving {row['placement_s']:6.2f} s  cut h3: found lost "
        f"{row['found_lost_s']} s, serving again {again}  per host besides the engine "
        f"{row['agent_rss_mb_per_host']:.0f} MiB in {row['agent_processes_per_host']} processes"
    )


# -- Prefect work pools ---------------------------------------------------------------------------


def _work_pools(workdir: Path, test_hosts: list[TestHost], policy: str) -> dict[str, Any]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from bench.cluster import start_worker, stop_process
    from deployments.cells import deploy_cells
    from stack.cell import CellOrder
    from stack.cluster_config import ClusterConfig
    from stack.fleet import CellFleet
    from stack.stack import local_stack
    from trajectory_store.storage import StoreConfig

    root = root_address(test_hosts[0])
    cluster = ClusterConfig.model_validate(
        {
            "hosts": [{"name": h.name, "address": h.address, "cells": 1} for h in test_hosts],
            "gateway_address": root,
            "heartbeat_misses": 3,
            "watch_interval_s": 1.0,
        }
    )
    with contextlib.ExitStack() as stack:
        api_url, env = stack.enter_context(prefect_server(workdir / "prefect", host=root))
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
        deploy_cells(cluster)
        worker_env = {
            **env,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_HEARTBEAT_SECONDS": str(HEARTBEAT_S),
        }
        for host in test_hosts:
            stack.callback(stop_process, start_worker(host, f"gyre-{host.name}", worker_env))
        serving = stack.enter_context(
            local_stack(policy, StoreConfig(data_root=str(workdir / "store")), engines=0, gateway_host=root)
        )
        fleet = CellFleet(cluster, CellOrder(policy=policy, gateway_url=serving.gateway_url))
        fleet.save_tokens(serving.admin_token, serving.engine_admin_token)
        admin = stack.enter_context(
            AdminClient(serving.gateway_url, serving.admin_token, serving.engine_admin_token)
        )
        started = time.monotonic()
        fleet.start()
        stack.callback(fleet.stop)
        fleet.wait_serving(admin)
        placement_s = time.monotonic() - started
        memory = _agents(test_hosts)
        stop = threading.Event()
        watch = threading.Thread(target=fleet.watch, args=(admin, stop), daemon=True)
        watch.start()
        stack.callback(stop.set)
        found, recovery = _cut_and_wait(test_hosts[-1], admin, lambda: test_hosts[-1].name in fleet.lost)
    return {
        "placement_s": round(placement_s, 2),
        "found_lost_s": found,
        "recovery_s": recovery,
        **memory,
        "on_each_host": "gyre worker --pool gyre-<host>  (one process worker; the cells are its flow runs)",
    }


# -- prefect-ray ----------------------------------------------------------------------------------


def ray_cell(
    cell_id: str,
    names: dict[str, str],
    policy: str,
    gateway_url: str,
    tokens: dict[str, str],
) -> dict[str, Any]:
    """One cell, as a Ray task placed by Ray: its engine on the node's address, behind the gateway,
    until the Prefect variable STOP_VARIABLE stops saying "serve"."""
    import ray
    from prefect.variables import Variable

    from stack.cell import serve_cell
    from stack.serving import ServingConfig

    address = ray.util.get_node_ip_address()

    def should_stop() -> str | None:
        with contextlib.suppress(Exception):  # the API out of reach (this host cut off): serve on
            value = Variable.get(STOP_VARIABLE)
            if value != "serve":
                return f"the variable {STOP_VARIABLE} says {value!r}"
        return None

    return serve_cell(
        cell_id,
        names[address],
        address,
        policy,
        gateway_url,
        ServingConfig(),
        tokens["admin_token"],
        tokens["engine_admin_token"],
        should_stop=should_stop,
    )


def ray_cells(names: dict[str, str], policy: str, gateway_url: str, tokens: dict[str, str]) -> list[dict]:
    """The flow of the prefect-ray way: one ``ray_cell`` task a cell, each placed by Ray on a node with
    a free ``cell`` slot (SPREAD), run again on a live node if its node dies (max_retries)."""
    from prefect import task
    from prefect_ray.context import remote_options

    cell_task = task(ray_cell, name="ray-cell")
    futures = []
    for i in range(CELLS):
        with remote_options(num_cpus=0, resources={"cell": 1}, scheduling_strategy="SPREAD", max_retries=3):
            futures.append(cell_task.submit(f"cell-{i}", names, policy, gateway_url, tokens))
    return [f.result() for f in futures]


def _prefect_ray(workdir: Path, test_hosts: list[TestHost], policy: str) -> dict[str, Any]:
    import ray
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.variables import Variable
    from prefect_ray import RayTaskRunner

    from engines.net import free_port
    from stack.stack import local_stack
    from trajectory_store.storage import StoreConfig

    root = root_address(test_hosts[0])
    ray_bin = str(Path(sys.executable).parent / "ray")
    with contextlib.ExitStack() as stack:
        api_url, env = stack.enter_context(prefect_server(workdir / "prefect", host=root))
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
        ray_env = {
            **env,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
        }
        port = free_port(root)
        common = ["--object-store-memory=100000000", "--disable-usage-stats"]
        stack.callback(subprocess.run, [ray_bin, "stop", "--force"], capture_output=True, env=ray_env)
        stack.callback(ray.shutdown)  # first: a driver whose GCS is gone ends its own process
        subprocess.run(
            [
                ray_bin,
                "start",
                "--head",
                f"--node-ip-address={root}",
                f"--port={port}",
                "--num-cpus=0",
                "--include-dashboard=false",
                *common,
            ],
            check=True,
            capture_output=True,
            env=ray_env,
        )
        started = time.monotonic()
        for host in test_hosts:
            host.run(
                [
                    ray_bin,
                    "start",
                    f"--address={root}:{port}",
                    f"--node-ip-address={host.address}",
                    "--num-cpus=2",
                    f"--resources={json.dumps({'cell': 2})}",
                    *common,
                ],
                env=ray_env,
            )
        nodes_s = time.monotonic() - started
        serving = stack.enter_context(
            local_stack(policy, StoreConfig(data_root=str(workdir / "store")), engines=0, gateway_host=root)
        )
        tokens = {"admin_token": serving.admin_token, "engine_admin_token": serving.engine_admin_token}
        names = {h.address: h.name for h in test_hosts}
        Variable.set(STOP_VARIABLE, "serve", overwrite=True)
        task_runner = RayTaskRunner(
            address=f"{root}:{port}",
            init_kwargs={
                "_node_ip_address": root,
                "runtime_env": {
                    "env_vars": {"PREFECT_API_URL": api_url, "PREFECT_HOME": env["PREFECT_HOME"]}
                },
            },
        )
        cells = flow(ray_cells, name="ray-cells", task_runner=task_runner)
        context = contextvars.copy_context()  # the flow's thread talks to this Prefect server

        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["cells"] = context.run(cells, names, policy, serving.gateway_url, tokens)
            except BaseException as exc:  # reported below
                result["error"] = exc

        admin = stack.enter_context(
            AdminClient(serving.gateway_url, serving.admin_token, serving.engine_admin_token)
        )
        started = time.monotonic()
        runner = threading.Thread(target=run, name="ray-cells", daemon=True)
        runner.start()
        deadline = time.monotonic() + 600
        while len([e for e in admin.gateway_stats().engines if e.state == "active"]) < CELLS:
            if not runner.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cells never all served: {result.get('error')!r}")
            time.sleep(0.2)
        placement_s = time.monotonic() - started
        memory = _agents(test_hosts)
        cut = test_hosts[-1]

        def dead() -> bool:
            return any(n["NodeManagerAddress"] == cut.address and not n["Alive"] for n in ray.nodes())

        found, recovery = _cut_and_wait(cut, admin, dead, timeout_s=REPLACE_TIMEOUT_S)
        task_runs = _task_runs()
        Variable.set(STOP_VARIABLE, "stop", overwrite=True)
        runner.join(60)
    return {
        "placement_s": round(placement_s, 2),
        "nodes_joined_s": round(nodes_s, 2),
        "found_lost_s": found,
        "recovery_s": recovery,
        **memory,
        "replaced_within_s": None if recovery is not None else REPLACE_TIMEOUT_S,
        "cell_task_runs": task_runs,
        "flow_ended": "error" if "error" in result else ("running" if runner.is_alive() else "completed"),
        "flow_error": f"{type(result['error']).__name__}: {result['error']}"[:400]
        if "error" in result
        else None,
        "on_each_host": "ray start --address=<head>:<port> --resources='{\"cell\": N}'  (a Ray node: "
        "raylet, workers, agents; gyrerl installed for its workers)",
    }


def _task_runs() -> dict[str, str]:
    """The Prefect task runs of the cells: name -> state (what the UI shows)."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return {
            f"{run.name} ({str(run.id)[:8]})": f"{run.state.type.value} {run.state.message or ''}".strip()
            for run in client.read_task_runs()
            if run.state is not None
        }


# -- both -----------------------------------------------------------------------------------------


def _cut_and_wait(
    host: TestHost, admin: AdminClient, lost, timeout_s: float = 300.0
) -> tuple[float | None, float | None]:
    """Cuts ``host`` off; (seconds until ``lost()``, seconds until every cell it held serves elsewhere),
    None for what did not happen within ``timeout_s``."""
    mine = sorted(e.engine_id for e in admin.gateway_stats().engines if f"//{host.address}:" in e.url)
    if not mine:
        raise RuntimeError(f"no cell runs on {host.name}")
    cut_off(host)
    cut_at = time.monotonic()
    found = None
    deadline = cut_at + timeout_s
    while True:
        if found is None and lost():
            found = time.monotonic() - cut_at
        engines = {e.engine_id: e for e in admin.gateway_stats().engines}
        moved = [
            c
            for c in mine
            if c in engines and engines[c].state == "active" and f"//{host.address}:" not in engines[c].url
        ]
        if len(moved) == len(mine):
            break
        if time.monotonic() > deadline:
            return (round(found, 2) if found is not None else None), None
        time.sleep(0.2)
    recovery = time.monotonic() - cut_at
    return round(found if found is not None else recovery, 2), round(recovery, 2)


def _namespace_pids(host: TestHost) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _agents(test_hosts: list[TestHost]) -> dict[str, Any]:
    """Resident memory and processes, per host, of what runs there besides the engines."""
    rss, counts = [], []
    for host in test_hosts:
        total, n = 0, 0
        for pid in _namespace_pids(host):
            with contextlib.suppress(OSError):
                command = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                if "engines.rollout" in command or "engines.vllm" in command:
                    continue
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        n += 1
        rss.append(total)
        counts.append(n)
    return {
        "agent_rss_mb_per_host": round(sum(rss) / len(rss) / 2**20, 1),
        "agent_processes_per_host": round(sum(counts) / len(counts), 1),
    }


def _kill_all(host: TestHost) -> None:
    """Every process left in the host's namespace (an engine a cut-off cell never stopped, Ray's)."""
    if host.netns is None:
        return
    for pid in _namespace_pids(host):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def main(out: str = "bench/results/placement.json") -> int:
    import importlib.util
    import tempfile

    if importlib.util.find_spec("prefect_ray") is None:
        print("gyre bench placement needs Ray and prefect-ray: run `make ray`", file=sys.stderr)
        return 2
    if shutil.which("ip") is None or os.geteuid() != 0:
        print("gyre bench placement needs network namespaces (`ip`, as root)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gyre-bench-placement-") as tmp:
        figures = compare_placement(Path(tmp))
    Path(out).write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
