"""A campaign's cells on its hosts (``[cluster]``): placed, started, watched and replaced.

    [cluster]
    hosts = [
      {name = "h1", address = "10.0.0.11", cells = 2},                    # work pool gyre-h1
      {name = "h2", address = "10.0.0.12", cells = 1, work_pool = "b"},
    ]

Each host runs one process worker of its own work pool (`gyre worker --pool gyre-h1`); a cell is a
flow run there (stack/cell.py). ``CellFleet`` places cells on hosts, starts their flow runs through
the Prefect API, and watches the hosts' workers: a host whose worker has not beaten for
``heartbeat_misses`` of its heartbeats, and none of whose cells' engines answers its health check,
is lost. Each cell on a lost host is marked Crashed (with the reason), declared dead at the gateway
(its calls in flight re-run on other engines from their recorded prompts, its sessions recompute
their context on their next call) and started again, under the same id, on the live host holding
the fewest cells. A single-host campaign needs none of this: without ``[cluster]`` the stack of
stack/up.py runs every engine on this machine.

    fleet = CellFleet(cluster, CellOrder(policy="/models/p", gateway_url=url))
    fleet.save_tokens(admin_token, engine_admin_token)
    fleet.start(); fleet.wait_serving(admin)
    fleet.replace_lost(admin)          # what fleet.watch(admin, stop) does every watch_interval_s
    fleet.stop()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import httpx

from engines.admin import AdminClient, AdminError
from stack.cluster_config import ClusterConfig

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient

from stack.cell import CELL_FLOW, CellOrder

log = logging.getLogger(__name__)


def _answers(url: str | None, timeout_s: float = 2.0) -> bool:
    if url is None:
        return False
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class CellRun:
    cell_id: str
    host: str
    flow_run_id: str
    slot: int = 0  # which of its host's device lists it took


@dataclass(frozen=True)
class Replacement:
    cell_id: str
    lost_host: str  # where it ran (its own host again: its run ended there)
    host: str  # where it runs now
    flow_run_id: str
    why: str


class CellFleet:
    """A campaign's cells on its hosts: started, watched and replaced through the Prefect API (the
    current PREFECT_API_URL), joined to the gateway the order names."""

    def __init__(
        self, cluster: ClusterConfig, order: CellOrder, *, clock: Callable[[], datetime] | None = None
    ):
        from prefect.settings import PREFECT_API_URL

        self.cluster, self.order = cluster, order
        # the API of the caller's context, also for the watch thread (which need not see that context)
        self.api_url: str | None = PREFECT_API_URL.value()
        self.cells: dict[str, CellRun] = {}
        self.replacements: list[Replacement] = []
        self.lost: set[str] = set()
        self.restarts: dict[str, int] = {}
        self.given_up: dict[str, str] = {}  # cell id -> why: it ended more than max_restarts times
        self._now = clock or (lambda: datetime.now(UTC))

    def serving(self, version: int, weights: str) -> None:
        """The version the campaign serves now (``weights``: a URL every host reads): what a cell
        started from now on loads before it joins the gateway."""
        self.order = dataclasses.replace(self.order, weights=weights, version=version)

    @contextlib.contextmanager
    def _client(self) -> Iterator[SyncPrefectClient]:
        from prefect import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with contextlib.ExitStack() as stack:
            if self.api_url is not None:
                stack.enter_context(temporary_settings({PREFECT_API_URL: self.api_url}))
            yield stack.enter_context(get_client(sync_client=True))

    def save_tokens(self, admin_token: str, engine_admin_token: str) -> None:
        from prefect.blocks.system import Secret
        from prefect.settings import PREFECT_API_URL, temporary_settings

        value = {"admin_token": admin_token, "engine_admin_token": engine_admin_token}
        with temporary_settings({PREFECT_API_URL: self.api_url} if self.api_url else {}):
            Secret(value=value).save(self.order.tokens_block, overwrite=True)

    def start(self) -> list[CellRun]:
        """A flow run for every cell of the placement, on its host's pool."""
        return [self._start(cell_id, host) for cell_id, host in self.cluster.placement()]

    def _start(self, cell_id: str, host: str) -> CellRun:

        spec = self.cluster.host(host)
        taken = {c.slot for c in self.cells.values() if c.host == host and c.cell_id != cell_id}
        slot = next(i for i in range(len(self.cells) + 1) if i not in taken)
        from prefect.exceptions import ObjectNotFound

        with self._client() as client:
            try:
                deployment = client.read_deployment_by_name(f"{CELL_FLOW}/{host}")
            except ObjectNotFound:
                raise RuntimeError(
                    f"cell {cell_id}: the server has no deployment {CELL_FLOW}/{host}: register the cells' "
                    "deployments first (`gyre cluster deploy --config <campaign.toml>`)"
                ) from None
            run = client.create_flow_run_from_deployment(
                deployment.id,
                parameters=self.order.parameters(cell_id, spec, slot),
                name=f"{cell_id}-on-{host}",
            )
        self.cells[cell_id] = CellRun(cell_id, host, str(run.id), slot)
        return self.cells[cell_id]

    def wait_serving(self, admin: AdminClient, timeout_s: float = 300.0) -> dict[str, str]:
        """Waits until every cell's engine is active in the gateway at its host's address; cell id ->
        engine URL. Meanwhile the hosts are checked as by ``watch`` (a host without a live worker
        gives its cells to the others; a cell whose run ended starts again); a cell given up raises
        RuntimeError with why."""
        deadline = time.monotonic() + timeout_s
        checked = time.monotonic()
        while True:
            engines = {e.engine_id: e for e in admin.gateway_stats().engines}
            serving = {
                c.cell_id: engines[c.cell_id].url
                for c in self.cells.values()
                if c.cell_id in engines
                and engines[c.cell_id].state == "active"
                and f"//{self.cluster.host(c.host).address}:" in engines[c.cell_id].url
            }
            if len(serving) == len(self.cells):
                return serving
            if time.monotonic() - checked > self.cluster.watch_interval_s:
                self.replace_lost(admin)
                checked = time.monotonic()
            if self.given_up:
                raise RuntimeError("; ".join(f"cell {c}: {why}" for c, why in sorted(self.given_up.items())))
            if time.monotonic() > deadline:
                waiting = sorted(set(self.cells) - set(serving))
                raise TimeoutError(f"cells {waiting} are not serving after {timeout_s:g} s")
            time.sleep(0.5)

    def _declare_dead(self, admin: AdminClient, cell_id: str, message: str) -> None:
        """The cell's engine declared dead at every gateway of the campaign (its calls there re-run)."""
        try:
            admin.declare_dead(cell_id, message)
        except AdminError as exc:  # not in the gateway (it never started): nothing to declare
            log.warning("cell %s: %s", cell_id, exc)
        for url in self.order.more_gateways:
            try:
                with AdminClient(url, admin.gateway_token, admin.engine_token) as other:
                    other.declare_dead(cell_id, message)
            except (AdminError, httpx.HTTPError) as exc:
                log.warning("cell %s at gateway %s: %s", cell_id, url, exc)

    def lost_hosts(self) -> dict[str, str]:
        """Hosts holding cells whose pool has no worker that beat within ``heartbeat_misses`` of its
        heartbeats: host -> why."""

        now, lost = self._now(), {}
        with self._client() as client:
            for host in {c.host for c in self.cells.values()}:
                pool = self.cluster.host(host).pool()
                beats = [
                    (now - w.last_heartbeat_time).total_seconds() / (w.heartbeat_interval_seconds or 30)
                    for w in client.read_workers_for_work_pool(pool)
                    if w.last_heartbeat_time is not None
                ]
                if not beats or min(beats) > self.cluster.heartbeat_misses:
                    silent = f"{min(beats):.1f} heartbeats" if beats else "ever"
                    lost[host] = f"no worker of pool {pool} has beaten for {silent}"
        return lost

    def replace_lost(self, admin: AdminClient) -> list[Replacement]:
        """Every cell of a lost host: its flow run marked Crashed, its engine declared dead at the
        gateway, and a new run of it on the live host with the fewest cells. A cell whose run ended on
        a live host (its engine died, say) starts again there."""
        from prefect.states import Crashed

        lost = self._confirmed(self.lost_hosts(), admin)
        done = []
        with self._client() as client:
            ended = {
                c.cell_id: state
                for c in self.cells.values()
                if c.host not in lost
                and c.cell_id not in self.given_up
                and (state := client.read_flow_run(c.flow_run_id).state) is not None
                and state.is_final()
            }
        if ended or lost:
            self._serve_newest(admin, skip={c.cell_id for c in self.cells.values() if c.host in lost})
        for cell_id, state in sorted(ended.items()):
            cell = self.cells[cell_id]
            why = f"its flow run ended {state.name}: {state.message or ''}".strip()
            if self.restarts.get(cell_id, 0) >= self.cluster.max_restarts:
                self.given_up[cell_id] = f"{why} (started again {self.restarts[cell_id]} times: given up)"
                log.error("cell %s on %s: %s", cell_id, cell.host, self.given_up[cell_id])
                continue
            self.restarts[cell_id] = self.restarts.get(cell_id, 0) + 1
            run = self._start(cell_id, cell.host)
            done.append(Replacement(cell_id, cell.host, cell.host, run.flow_run_id, why))
            log.warning("cell %s on %s: %s: started again", cell_id, cell.host, why)
        for host, why in sorted(lost.items()):
            self.lost.add(host)
            for cell in [c for c in self.cells.values() if c.host == host]:
                message = f"host {host} lost: {why}"
                with self._client() as client:
                    client.set_flow_run_state(cell.flow_run_id, Crashed(message=message), force=True)
                self._declare_dead(admin, cell.cell_id, message)
                target = self._least_loaded()
                if target is None:
                    raise RuntimeError(f"cell {cell.cell_id}: host {host} is lost and no live host has room")
                run = self._start(cell.cell_id, target)
                done.append(Replacement(cell.cell_id, host, target, run.flow_run_id, why))
                log.warning(
                    "cell %s: host %s lost (%s): started again on %s", cell.cell_id, host, why, target
                )
        self.replacements += done
        return done

    def _serve_newest(self, admin: AdminClient, skip: set[str]) -> None:
        """The newest version a live engine serves, with the weights it was given, becomes what a
        cell started from now on loads: a scheduler process (tasks/schedule.py) serves versions that
        the campaign's process, which holds this fleet, never tells it (`serving`). ``skip``: the
        engines of lost hosts (a call to them would wait out its timeout)."""
        for engine in admin.gateway_stats().engines:
            if engine.state == "dead" or engine.engine_id in skip:
                continue
            try:
                stats = admin.engine_stats(engine.url)
            except (httpx.HTTPError, AdminError):  # on a lost host too: it serves nothing
                continue
            if (
                stats.policy_version is not None
                and stats.weights_path
                and stats.policy_version > self.order.version
            ):
                log.info(
                    "cells started from now on serve version %d (%s)", stats.policy_version, engine.engine_id
                )
                self.serving(stats.policy_version, stats.weights_path)

    def _confirmed(self, silent: dict[str, str], admin: AdminClient) -> dict[str, str]:
        """The hosts of ``silent`` (no worker beat) none of whose cells' engines answers /health: a
        host whose worker died or beats late while its engines serve is not lost (its cells serve on;
        replacing them would leave their engines running beside the new ones)."""
        if not silent:
            return {}
        urls = {e.engine_id: e.url for e in admin.gateway_stats().engines if e.state != "dead"}
        lost = {}
        for host, why in silent.items():
            answering = [
                c.cell_id for c in self.cells.values() if c.host == host and _answers(urls.get(c.cell_id))
            ]
            if answering:
                log.warning("host %s: %s, but its cells %s answer: not lost", host, why, answering)
            else:
                lost[host] = why
        return lost

    def _least_loaded(self) -> str | None:
        held = {h.name: 0 for h in self.cluster.hosts if h.name not in self.lost}
        for cell in self.cells.values():
            if cell.host in held:
                held[cell.host] += 1
        room = [
            name
            for name, n in held.items()
            if self.cluster.host(name).capacity() is None or n < self.cluster.host(name).capacity()
        ]
        return min(room, key=lambda name: (held[name], name)) if room else None

    def watch(self, admin: AdminClient, stop: threading.Event) -> None:
        """``replace_lost`` every ``watch_interval_s`` until ``stop`` is set; a check that fails is
        logged and tried again."""
        while not stop.wait(self.cluster.watch_interval_s):
            try:
                self.replace_lost(admin)
            except Exception:  # one failed check must not end the watch
                log.exception("cell fleet: checking the hosts failed")

    def stop(self, timeout_s: float = 60.0) -> dict[str, str]:
        """Cancels every cell's flow run (its worker stops the process, and with it the engine);
        cell id -> the run's last state."""
        from prefect.states import Cancelling

        with self._client() as client:
            for cell in self.cells.values():
                state = client.read_flow_run(cell.flow_run_id).state
                if state is None or not state.is_final():
                    client.set_flow_run_state(cell.flow_run_id, Cancelling(), force=True)
            deadline = time.monotonic() + timeout_s
            while True:
                states = {c.cell_id: client.read_flow_run(c.flow_run_id).state for c in self.cells.values()}
                if (
                    all(s is not None and s.is_final() for s in states.values())
                    or time.monotonic() > deadline
                ):
                    return {cell_id: s.name if s else "?" for cell_id, s in states.items()}
                time.sleep(0.5)
