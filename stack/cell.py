"""A cell's life on its host: the body of its long-lived Prefect flow run (flows/cell.py).

A cell is a flow run of the `gyre-cell` deployment on its host's work pool (registered per host by
`deployments/cells.py`): ``serve_cell`` starts the cell's engine on the host's address, adds it to
the campaign's gateway under the cell's id, and serves until the run is cancelled or marked crashed
(``run_ended``). The admin tokens reach the cell through a Prefect Secret block, never through its
parameters (which the UI shows). What places and replaces cells is stack/fleet.py; the hosts are
``[cluster]`` (stack/cluster_config.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engines.admin import AdminClient, AdminError
from engines.devices import CellDevices, process_env
from engines.devices.cpu_quota import cell_quota
from engines.net import free_port
from scheduler.remote import ReplicaServer
from stack.cluster_config import HostSpec
from stack.serving import ServingConfig, engine_process
from stack.stack import serving_process

log = logging.getLogger(__name__)

CELL_FLOW = "gyre-cell"
"""The cell flow's name: its deployment on host h is ``gyre-cell/h``."""
CORE_RANK_FLOW = "gyre-core-rank"
"""The flow of a core rank above 0 for one step (flows/cell.py): its deployment on h is ``gyre-core-rank/h``."""
TOKENS_BLOCK = "gyre-cell-tokens"
"""The Secret block with the gateway's and the engines' admin tokens, read by every cell."""


@dataclass(frozen=True)
class CellOrder:
    """What every cell of a campaign serves, and whose gateway it joins."""

    policy: str  # the policy folder, at the same path on every host
    gateway_url: str  # as the hosts reach it
    more_gateways: tuple[str, ...] = ()  # the campaign's other gateways ([cluster] gateways): cells join all
    serving: dict[str, Any] = field(default_factory=dict)  # ServingConfig fields (engine kind, threads, ...)
    tokens_block: str = TOKENS_BLOCK
    weights: str | None = None  # the version a cell started now loads first (a URL the hosts read)
    version: int = 0
    replica: bool = False  # each cell also serves a trainer replica (the elastic scheduler's cells)
    cpus: float | None = None  # each cell's CPU quota in cores ([cluster] cell_cpus)

    def parameters(self, cell_id: str, host: HostSpec, slot: int = 0) -> dict[str, Any]:
        """The cell flow run's parameters (shown in the UI: no secret); ``slot``: which of the host's
        device lists the cell takes."""
        return {
            "cell_id": cell_id,
            "host": host.name,
            "address": host.address,
            "policy": self.policy,
            "gateway_url": self.gateway_url,
            "more_gateways": list(self.more_gateways),
            "serving": self.serving,
            "tokens_block": self.tokens_block,
            "weights": self.weights,
            "version": self.version,
            "threads": host.threads,
            "devices": host.devices[slot] if host.devices is not None else None,
            "replica": self.replica,
            "cpus": self.cpus,
        }


def serve_cell(
    cell_id: str,
    host: str,
    address: str,
    policy: str,
    gateway_url: str,
    serving: ServingConfig,
    admin_token: str,
    engine_admin_token: str,
    *,
    should_stop: Callable[[], str | None],
    weights: str | None = None,
    version: int = 0,
    threads: int | None = None,
    gpus: list[int] | None = None,
    poll_s: float = 2.0,
    more_gateways: Sequence[str] = (),
    replica: bool = False,
    cpus: float | None = None,
) -> dict[str, Any]:
    """A cell's life on its host: its engine listening on ``address`` (serving ``weights`` as
    ``version`` when given: the campaign's current version, for a cell started mid-campaign), added to
    the gateway as ``cell_id`` on ``host``, until ``should_stop`` gives a reason (returned) or the
    engine dies (RuntimeError). The engine stops with the block, also when the flow run is cancelled.
    ``threads`` and ``gpus``: the engine's torch threads (None: ``serving``'s engine_threads) and
    visible GPUs (None: inherited). ``more_gateways``: the campaign's other gateways, which the engine
    joins too (one that does not answer is skipped, with a line saying so). ``replica``: the cell also
    serves a trainer replica of the policy on ``address`` (scheduler/remote.py), listed with its engine
    at the gateway as its ``trainer_url``: the elastic scheduler switches the cell to training.
    ``cpus``: the cell's CPU quota in cores, a cgroup its engine and replica are born in (removed once
    they stopped; where the machine refuses, a warning and no quota)."""
    with cell_quota(cell_id, cpus) as quota:  # removed last: once the engine and replica stopped
        [devices] = quota.place(
            [CellDevices(threads=threads or serving.engine_threads, gpus=gpus)], [cell_id]
        )
        policy = local_policy(policy)
        port = free_port(address)
        command, stdin, _ = engine_process(
            policy, serving, port, engine_admin_token, host=address, engine_id=cell_id
        )
        url = f"http://{address}:{port}"
        env = {**os.environ, **process_env(devices)}
        with (
            serving_process(command, url, env, stdin=stdin) as engine,
            AdminClient(gateway_url, admin_token, engine_admin_token) as admin,
            contextlib.ExitStack() as beside,
        ):
            trainer_url = None
            if replica:
                server = ReplicaServer(policy, address, engine_admin_token, cell=devices)
                trainer_url = beside.enter_context(server).url
            if weights is not None:
                admin.load_weights(url, weights, version, drop_kv=True)
            added = admin.add_engine(url, engine_id=cell_id, host=host, trainer_url=trainer_url)
            for other in more_gateways:
                try:
                    with AdminClient(other, admin_token, engine_admin_token) as more:
                        more.add_engine(url, engine_id=cell_id, host=host, trainer_url=trainer_url)
                except (AdminError, httpx.HTTPError) as exc:
                    print(f"cell {cell_id} on {host}: gateway {other} did not take the engine: {exc}")
            print(
                f"cell {cell_id} on {host}: engine {added.engine_id} at {url} serves {weights or policy} (v{version})"
                + (f"; its trainer replica at {trainer_url}" if trainer_url else "")
            )
            while True:
                if engine.poll() is not None:
                    raise RuntimeError(
                        f"cell {cell_id} on {host}: its engine at {url} exited with {engine.returncode}"
                    )
                reason = should_stop()
                if reason is not None:
                    print(f"cell {cell_id} on {host}: stopping ({reason})")
                    return {"cell_id": cell_id, "host": host, "url": url, "stopped": reason}
                for gateway in (gateway_url, *more_gateways):
                    rejoin(gateway, url, cell_id, host, admin_token, engine_admin_token, trainer_url)
                time.sleep(poll_s)


def rejoin(
    gateway: str,
    url: str,
    cell_id: str,
    host: str,
    admin_token: str,
    engine_admin_token: str,
    trainer_url: str | None = None,
) -> bool:
    """Adds the cell's engine to ``gateway`` again if the gateway answers without it: a gateway started
    again after its process died knows no engine. (Listed under its id, even as dead, it is left
    alone: the cell fleet moved it, or declared it dead.) Whether it was added."""
    try:
        with AdminClient(gateway, admin_token, engine_admin_token, timeout_s=5) as admin:
            if any(e.engine_id == cell_id for e in admin.gateway_stats().engines):
                return False
            admin.add_engine(url, engine_id=cell_id, host=host, trainer_url=trainer_url)
    except (AdminError, httpx.HTTPError):  # not up yet, or cut off: the next round tries again
        return False
    print(f"cell {cell_id} on {host}: joined gateway {gateway} again (it had started again without it)")
    return True


def local_policy(policy: str, cache: str | None = None) -> str:
    """A policy folder on this host: ``policy`` itself, or for a URL (the campaign's copy in object
    storage) a copy in ``cache`` (default ~/.cache/gyre/policies), fetched once."""
    if "://" not in policy or policy.startswith("file://"):
        return policy.removeprefix("file://")
    import hashlib

    import fsspec

    folder = os.path.join(
        cache or os.path.expanduser("~/.cache/gyre/policies"),
        hashlib.sha256(policy.encode()).hexdigest()[:16],
    )
    if not os.path.exists(os.path.join(folder, ".complete")):
        fs, root = fsspec.core.url_to_fs(policy)
        partial = f"{folder}.part-{os.getpid()}"
        fs.get(f"{root.rstrip('/')}/", f"{partial}/", recursive=True)
        Path(partial, ".complete").touch()
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)
    return folder


def run_ended(flow_run_id: str) -> str | None:
    """Why the cell's own flow run should end (cancelled, or marked crashed because its host was
    lost), or None. An API that does not answer (this host cut off) is no reason: the cell serves on."""
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception as exc:  # the API unreachable (this host cut off): keep serving
        log.warning("cell: the Prefect API did not answer (%s): serving on", exc)
        return None
    if state is not None and (state.is_final() or state.name == "Cancelling"):
        return f"its flow run is {state.name}: {state.message or ''}".strip()
    return None
