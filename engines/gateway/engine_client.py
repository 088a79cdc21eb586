"""EngineClient: the gateway's HTTP link to one rollout engine.

Requests and answers are engines/protocol.py's models, the ones the engine server uses: an
EngineCompletionRequest goes out, an EngineCompletion comes back (an answer that does not parse is an
EngineRejected with status 502). Generation uses only the vLLM-compatible subset (token-id prompt,
sampling fields, stop_token_ids, logprobs, return_tokens_as_token_ids + return_token_ids; read token_ids,
token_logprobs, finish_reason, usage), plus session_id and request_id, which recent vLLM declares too.
Our server's per-choice ``gyre`` extension (engine id, policy versions, prefilled tokens, migrated) is
read when present. KV migration and the policy version use our admin endpoints (engines/admin.py:
EXPORT_SESSION, IMPORT_SESSION, ENGINE_STATS, their models and their paths): a vLLM engine can serve
but not be drained with its KV (its sessions are then recomputed elsewhere).

Transport: generation goes through http.py's KeepAliveClient (one send per request, ~2 ms less per
call than httpx, see there); admin calls go through httpx, built and parsed by the admin endpoints.
Failure mapping: no connection, or a connection dropped mid-request -> EngineDown (the router marks the
engine dead and re-runs the call elsewhere); a timeout, an error status or an answer that does not
parse -> EngineRejected.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal, TypeVar

import httpx
import orjson
from pydantic import BaseModel, ValidationError

from engines.admin import (
    ENGINE_STATS,
    EXPORT_SESSION,
    IMPORT_SESSION,
    AdminError,
    Endpoint,
    EngineStatsReport,
    SessionExport,
    SessionImport,
    SessionImported,
)
from engines.gateway.errors import EngineDown, EngineRejected
from engines.gateway.http import KeepAliveClient
from engines.net import host_of
from engines.protocol import EngineCompletion, EngineCompletionRequest, ModelList

EngineState = Literal["active", "draining", "dead"]
Parsed = TypeVar("Parsed", bound=BaseModel)
Answer = TypeVar("Answer")
_JSON = {"content-type": "application/json"}


class EngineClient:
    """Attributes: engine_id, url, state ('active' takes new sessions; 'draining' keeps serving what it
    holds until moved; 'dead' gets nothing), in_flight (requests the gateway has sent and not yet got
    back), sessions (ids of the sessions bound to it), model_name / max_model_len (from /v1/models),
    policy_version (from /admin/stats; per-token versions in responses take precedence), host (the host
    it runs on: its spec's, or its URL's; a session's KV moves between two hosts over TCP)."""

    def __init__(
        self,
        engine_id: str,
        url: str,
        *,
        admin_token: str | None = None,
        connect_timeout_s: float = 5.0,
        timeout_s: float | None = None,
        host: str | None = None,
    ):
        self.engine_id = engine_id
        self.url = url.rstrip("/")
        self.host = host or host_of(self.url)
        self.trainer_url: str | None = None  # its cell's trainer replica (EngineSpec.trainer_url)
        self.admin_token = admin_token
        self.state: EngineState = "active"
        self.in_flight = 0
        self.sessions: set[str] = set()
        self.model_name: str | None = None
        self.max_model_len: int | None = None
        self.policy_version: int | None = None
        self.calls = 0
        self.fast = KeepAliveClient(self.url, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    @property
    def load(self) -> int:
        return len(self.sessions) + self.in_flight

    async def probe(self) -> str | None:
        """Reads the served model and its limits (and, with an admin token, the policy version); returns
        the engine's own id: our engines give it in /v1/models (no token needed) and /admin/stats; a
        vLLM engine has none (None)."""
        models = self._parse(ModelList, await self._get("/v1/models"))
        own_id = None
        if models.data:
            self.model_name = models.data[0].id
            self.max_model_len = models.data[0].max_model_len
            own_id = models.data[0].engine_id
        if self.admin_token:
            stats = await self.stats()
            self.policy_version = stats.policy_version
            own_id = own_id or stats.engine_id
        return own_id

    async def generate(self, request: EngineCompletionRequest) -> EngineCompletion:
        if self.model_name is not None:
            request = request.model_copy(update={"model": self.model_name})
        self.calls += 1
        # None fields are left out, as a vLLM server of an older version may not accept null for them
        content = request.model_dump_json(exclude_none=True).encode()
        try:
            status, data = await self.fast.request("POST", "/v1/completions", content, dict(_JSON))
        except TimeoutError as exc:
            raise EngineRejected(self.engine_id, 504, "timed out") from exc
        except (OSError, asyncio.IncompleteReadError) as exc:  # ConnectionError is an OSError
            raise EngineDown(self.engine_id, repr(exc)) from exc
        if status >= 400:
            raise EngineRejected(self.engine_id, status, _message(data))
        return self._parse(EngineCompletion, data)

    async def export_session(
        self, session_id: str, transport: Literal["shm", "tcp"] = "shm"
    ) -> dict[str, Any] | None:
        """The session's KV handle, or None when this engine holds no such session. ``transport``: shm
        for an importer on this engine's host, tcp for one on another host."""
        try:
            return await self._admin(
                EXPORT_SESSION, SessionExport(session_id=session_id, transport=transport)
            )
        except EngineRejected as exc:
            if exc.status == 404:
                return None
            raise

    async def import_session(
        self, handle: dict[str, Any], *, wait: bool
    ) -> EngineCompletion | SessionImported:
        """The imported session; with wait=true and a request in flight, that request's completion."""
        return await self._admin(IMPORT_SESSION, SessionImport(handle=handle, wait=wait))

    async def stats(self) -> EngineStatsReport:
        return await self._admin(ENGINE_STATS)

    async def healthy(self, timeout_s: float) -> bool:
        """Whether GET /health answers 200 within ``timeout_s`` (connecting included)."""
        try:
            answer = await self.client.get("/health", timeout=timeout_s)
        except (httpx.HTTPError, OSError):
            return False
        return answer.status_code == 200

    def abort(self, reason: str) -> None:
        """Ends its calls in flight (each raises EngineDown, so the router re-runs it elsewhere) and
        every later one: an engine that stopped answering without closing its connections."""
        self.fast.abort(reason)

    async def close(self) -> None:
        await self.fast.close()
        await self.client.aclose()

    def _parse(self, model: type[Parsed], data: bytes) -> Parsed:
        try:
            return model.model_validate_json(data)
        except ValidationError as exc:
            raise self._invalid(model.__name__, exc) from exc

    def _invalid(self, what: str, exc: ValidationError) -> EngineRejected:
        return EngineRejected(self.engine_id, 502, f"its answer is not a valid {what}: {exc.errors()[:3]}")

    async def _get(self, path: str) -> bytes:
        """An unauthenticated GET (/v1/models): the body, once the status says it is an answer."""
        response = await self._send(method="GET", url=path)
        if response.status_code >= 400:
            raise EngineRejected(self.engine_id, response.status_code, _message(response.content))
        return response.content

    async def _admin(self, endpoint: Endpoint[Answer], body: BaseModel | None = None) -> Answer:
        if not self.admin_token:
            raise EngineRejected(self.engine_id, 403, "no admin token configured for this engine")
        response = await self._send(**endpoint.request("", self.admin_token, body))
        try:
            return endpoint.read(response)
        except AdminError as exc:
            raise EngineRejected(self.engine_id, exc.status, _message(response.content)) from exc
        except ValidationError as exc:
            raise self._invalid(endpoint.path, exc) from exc

    async def _send(self, **request: Any) -> httpx.Response:
        try:
            return await self.client.request(**request)
        except httpx.TimeoutException as exc:
            raise EngineRejected(self.engine_id, 504, f"timed out: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise EngineDown(self.engine_id, repr(exc)) from exc


def _message(data: bytes) -> str:
    """The error message of an OpenAI-style ({"error": {"message"}}) or FastAPI ({"detail"}) body."""
    try:
        error = orjson.loads(data)
        return str(error.get("error", {}).get("message") or error.get("detail") or data[:500].decode())
    except (orjson.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return data[:500].decode(errors="replace")
