"""Several gateways for one dispatcher: each execution pinned to one by its id, standing by on the next.

    async with httpx.AsyncClient() as client:
        pool = GatewayPool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], admin_token, client)
        registration = await pool.register("s0-p-g0", problem_id="p", step=0)
        registration["base_urls"]     # [its gateway's base_url, the standby's]: the harness's relay's order
        await pool.finish("s0-p-g0", "completed", reward=1.0, reward_source="final")

GatewayPool has GatewayAdmin's register/finish, so ExecutionRunner takes either. An execution's order
over the gateways is rendezvous hashing of its id (the highest sha256 of url + id first): every
dispatcher agrees on it, and a gateway added or removed moves only the executions it gains or held.

``register`` registers the execution at the first gateway of its order that answers (its primary),
then at the next one that answers (its standby) under the same api_key, with call ids numbered from
STANDBY_CALL_BASE there, so calls recorded by the two never share an id (call_id stays the order
within the execution: the standby takes calls only after the primary is gone). The harness reaches
them through a relay (environments/relay.py) that moves to the standby, for good, once the primary
refuses a connection.

``finish`` records the ending at the first of the two that still holds the execution live; the other,
if it answers, releases it (flushing the calls it took, recording no row) and its calls count in the
ending's n_calls. A gateway that died keeps the calls it answered in its spool, and writes them when
it is started again (docs/reliability.md, the spool). If neither answers, the finish fails as with
one gateway: the roll-out task's retry runs the member again as a new attempt.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from environments.gateway_admin import GatewayAdmin, GatewayAdminError
from trajectory_store.schema import Status

log = logging.getLogger(__name__)

STANDBY_CALL_BASE = 1 << 20
"""The call_id of an execution's first call at its standby gateway (above any execution's calls at its
primary: LimitsConfig.max_calls_per_execution is far below it)."""


def gateway_order(urls: Sequence[str], execution_id: str) -> list[str]:
    """``urls`` in the execution's order (rendezvous hashing on its id)."""
    return sorted(
        urls, key=lambda url: hashlib.sha256(f"{url}|{execution_id}".encode()).digest(), reverse=True
    )


class GatewayPool:
    """Attributes: gateways (url -> GatewayAdmin), placed (execution id -> its gateways: primary, then
    standby if one answered)."""

    def __init__(self, urls: Sequence[str], token: str, client: httpx.AsyncClient):
        if len(set(urls)) != len(urls) or not urls:
            raise ValueError(f"a gateway pool needs distinct gateway urls, got {list(urls)}")
        self.gateways = {url.rstrip("/"): GatewayAdmin(url, token, client) for url in urls}
        self.placed: dict[str, list[GatewayAdmin]] = {}

    def order(self, execution_id: str) -> list[GatewayAdmin]:
        return [self.gateways[url] for url in gateway_order(list(self.gateways), execution_id)]

    async def register(self, execution_id: str, **fields: Any) -> dict[str, Any]:
        """GatewayAdmin.register at the primary, then at the standby; the primary's answer with
        ``base_urls`` (the gateways in the order the harness's relay tries them)."""
        order = self.order(execution_id)
        registrations: list[dict[str, Any]] = []
        placed, unreachable = [], []
        for gateway in order:
            try:
                if not registrations:
                    registration = await gateway.register(execution_id, **fields)
                else:
                    standby = {"api_key": registrations[0]["api_key"], "first_call_id": STANDBY_CALL_BASE}
                    registration = await gateway.register(execution_id, **fields, **standby)
            except httpx.TransportError as exc:
                unreachable.append(f"{gateway.url} ({type(exc).__name__})")
                continue
            except GatewayAdminError as exc:
                if not registrations:  # the primary's refusal (409 superseded, finished) is the caller's
                    raise
                unreachable.append(f"{gateway.url} (refused: {exc})")
                continue
            placed.append(gateway)
            registrations.append(registration)
            if len(placed) == 2:
                break
        if not registrations:
            raise GatewayAdminError(
                "/admin/executions", 503, f"no gateway answered: {', '.join(unreachable)}", code="no_gateway"
            )
        if len(placed) < 2 and len(order) > 1:
            log.warning("execution %s has no standby gateway: %s", execution_id, ", ".join(unreachable))
        self.placed[execution_id] = placed
        return {**registrations[0], "base_urls": [r["base_url"] for r in registrations]}

    async def finish(self, execution_id: str, status: Status, **ending: Any) -> dict[str, Any]:
        """GatewayAdmin.finish (``ending``: its reward, reward_source, snapshot_uri) at the first of the
        execution's gateways that holds it live; the other releases it."""
        placed = self.placed.pop(execution_id, None) or self.order(execution_id)[:2]
        live, failures = [], []
        for gateway in placed:
            try:
                await gateway.execution(execution_id)
            except (httpx.TransportError, GatewayAdminError) as exc:
                failures.append(f"{gateway.url}: {exc}")
                continue
            live.append(gateway)
        if not live:
            raise GatewayAdminError(
                f"/admin/executions/{execution_id}/finish",
                503,
                f"no gateway holds execution {execution_id} live any more: {'; '.join(failures)}",
                code="no_gateway",
            )
        finisher, others = live[0], live[1:]
        elsewhere = 0
        for gateway in others:
            elsewhere += int((await gateway.release(execution_id)).get("calls") or 0)
        finished = await finisher.finish(execution_id, status, **ending, calls_elsewhere=elsewhere)
        return {**finished, "calls": int(finished.get("calls") or 0) + elsewhere}
