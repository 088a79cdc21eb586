"""The gateway's execution admin API, as environments/ reaches it: over HTTP only (environments/ never
imports engines/, DESIGN.md section 3), so this module spells the execution paths the gateway routes
(engines/admin.py holds the gateway's side of them, and the typed engine-management wire).

    async with httpx.AsyncClient() as client:
        admin = GatewayAdmin(gateway_url, admin_token, client)
        registration = await admin.register("s0-p-g0", problem_id="p", step=0)   # base_url, api_key, ...
        await admin.finish("s0-p-g0", "completed", reward=1.0, reward_source="final")

The dispatcher registers and finishes every execution through it, and so do `gyre execution
register|finish` and an external orchestrator.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from trajectory_store.schema import RewardSource, Status

EXECUTIONS = "/admin/executions"
"""POST: register an execution -> {execution_id, step, campaign, base_url, agent_base_url, api_key, created}."""
STATS = "/admin/stats"
"""GET: the gateway's engines, counters, and where it records (store, step)."""


def execution_path(execution_id: str) -> str:
    """GET: a live execution -> {execution_id, step, calls, agents}."""
    return f"{EXECUTIONS}/{execution_id}"


def finish_path(execution_id: str) -> str:
    """POST {status, reward, reward_source, snapshot_uri, calls_elsewhere} -> {execution_id, status, calls, flush}."""
    return f"{execution_path(execution_id)}/finish"


def release_path(execution_id: str) -> str:
    """POST -> {execution_id, calls, flush}: the execution leaves a gateway without a row there."""
    return f"{execution_path(execution_id)}/release"


class GatewayAdminError(RuntimeError):
    """The gateway refused an admin request; ``status`` is its HTTP status and ``code`` its error
    code (409 execution_finished: the id is finished there and cannot be registered again; 409
    execution_superseded: it belonged to an abandoned attempt)."""

    def __init__(self, path: str, status: int, text: str, code: str | None = None):
        super().__init__(f"gateway {path} answered {status}: {text[:500]}")
        self.path, self.status, self.code = path, status, code
        if code is None:  # the gateway's OpenAI-style body names it
            try:
                self.code = (json.loads(text).get("error") or {}).get("code")
            except (ValueError, AttributeError):
                self.code = None


class GatewayAdmin:
    """The gateway's admin API for executions: register, finish, and the gateway's stats. The same
    calls an external orchestrator makes (`gyre execution register|finish` use this class)."""

    def __init__(self, url: str, token: str, client: httpx.AsyncClient):
        self.url, self.client = url.rstrip("/"), client
        self.headers = {"Authorization": f"Bearer {token}"}

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self.client.request(
            method, f"{self.url}{path}", json=body, headers=self.headers, timeout=120
        )
        if response.status_code != 200:
            raise GatewayAdminError(path, response.status_code, response.text)
        return response.json()

    async def register(
        self,
        execution_id: str,
        *,
        problem_id: str | None = None,
        group_id: str | None = None,
        step: int | None = None,
        harness: str | None = None,
        campaign: str | None = None,
        attempt: str | None = None,
        api_key: str | None = None,
        first_call_id: int = 0,
    ) -> dict[str, Any]:
        """{execution_id, step, campaign, base_url, agent_base_url, api_key, created}. ``api_key`` and
        ``first_call_id``: a standby registration (environments/gateways.py)."""
        body = {
            "execution_id": execution_id,
            "problem_id": problem_id,
            "group_id": group_id,
            "step": step,
            "harness": harness,
            "campaign": campaign,
            "attempt": attempt,
        }
        if api_key is not None:
            body.update(api_key=api_key, first_call_id=first_call_id)
        return await self._request("POST", EXECUTIONS, body)

    async def finish(
        self,
        execution_id: str,
        status: Status,
        *,
        reward: float | None,
        reward_source: RewardSource | None = None,
        snapshot_uri: str | None = None,
        calls_elsewhere: int = 0,
    ) -> dict[str, Any]:
        """{execution_id, status, calls, flush}: the gateway records the execution next to its calls;
        ``calls_elsewhere`` (other gateways answered them) counts in its n_calls."""
        body = {
            "status": status,
            "reward": reward,
            "reward_source": reward_source,
            "snapshot_uri": snapshot_uri,
        }
        if calls_elsewhere:
            body["calls_elsewhere"] = calls_elsewhere
        return await self._request("POST", finish_path(execution_id), body)

    async def release(self, execution_id: str) -> dict[str, Any]:
        """{execution_id, calls, flush}: the execution leaves this gateway, which records no row for it
        (another one records its ending)."""
        return await self._request("POST", release_path(execution_id))

    async def execution(self, execution_id: str) -> dict[str, Any]:
        """A live execution: {execution_id, step, calls, agents}."""
        return await self._request("GET", execution_path(execution_id))

    async def stats(self) -> dict[str, Any]:
        """/admin/stats: engines, counters, and where the gateway records (store, step)."""
        return await self._request("GET", STATS)
