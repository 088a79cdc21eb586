"""The admin wire of the rollout engines and of the gateway's engine management: every ``/admin/`` path,
typed request and response models both sides import, and the client every caller uses, as
engines/protocol.py types the completion wire.

    with AdminClient(gateway_url, gateway_token, engine_token) as admin:
        admin.drain("rollout-8101")                           # -> DrainReport
        admin.sleep(engine_url)                               # -> SleepState
        admin.wake(engine_url, "/fast/policy-v3.safetensors", 3)
        admin.activate("rollout-8101")
        engines = admin.gateway_stats().engines               # -> list[EngineView]

An engine (engines/rollout/server.py)                       the gateway (engines/gateway/app.py)
    POST ENGINE_WEIGHTS   WeightsRequest -> WeightsLoaded       GET  GATEWAY_STATS    -> GatewayStatsReport
    POST ENGINE_SLEEP     -> SleepState                         POST GATEWAY_FLUSH    -> FlushReport
    POST ENGINE_WAKE      WakeRequest -> SleepState             POST ADD_ENGINE       AddEngine -> EngineAdded
    POST EXPORT_SESSION   SessionExport -> the transport's handle    POST DRAIN_ENGINE  -> DrainReport
    POST IMPORT_SESSION   SessionImport -> SessionImported, or the   POST ACTIVATE_ENGINE -> EngineActivated
                          migrated request's EngineCompletion (wait=true)    POST ENGINE_DEAD -> EngineDeclaredDead
    GET  ENGINE_STATS     -> EngineStatsReport

Each ``Endpoint`` holds its method, its path (a template where it names an engine or an execution) and
the type its answer parses into; a server routes on ``endpoint.path``, a client sends with
``endpoint.request(...)`` and parses with ``endpoint.read(response)``. ``AdminClient`` (sync, httpx)
is the client of the scheduler's cells, the campaign's services and the benchmarks; the gateway reaches
its engines asynchronously through engines/gateway/engine_client.py, with the same endpoints.

The counters an engine and the gateway keep (EngineCounters, GatewayCounters, RouterCounters) are
defined here, because they are what the stats endpoints carry: the servers count into them and the
reports extend them. Every model is lenient (unknown fields are ignored), so an older client reads a
newer server.

The gateway's execution admin (register, finish, look up: REGISTER_EXECUTION, EXECUTION,
FINISH_EXECUTION) is routed here too, but its client lives in environments/gateway_admin.py with its
own spelling of those three paths: environments/ reaches the gateway only over HTTP and never imports
engines/ (DESIGN.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, Literal, TypeVar

import httpx
from pydantic import BaseModel, Field, TypeAdapter

from engines.devices import DevicesReport
from engines.protocol import ID_PATTERN, EngineCompletion, WireModel

Answer = TypeVar("Answer")


# an engine's bodies -----------------------------------------------------------------------------------
class WeightsRequest(WireModel):
    """POST /admin/weights: hot-swap the weights (the engine keeps serving)."""

    path: str = Field(description="a safetensors file or an HF folder, on the engine's host")
    version: int | None = Field(None, description="None = the file's 'version' metadata")
    drop_kv: bool = Field(False, description="drop every session's KV (it was computed by older weights)")


class WakeRequest(WireModel):
    """POST /admin/wake: load these weights and serve again."""

    path: str = Field(description="a safetensors file or an HF folder, on the engine's host")
    version: int | None = Field(None, description="None = the file's 'version' metadata")


class WeightsLoaded(WireModel):
    policy_version: int


class SleepState(WireModel):
    """The answer of sleep (no weights, no KV held) and of wake."""

    asleep: bool
    policy_version: int | None = None


class SessionExport(WireModel):
    """POST /admin/export_session: the session whose KV (and request in flight) leaves the engine."""

    session_id: str
    transport: Literal["shm", "tcp"] = Field(
        "shm",
        description="shm: a file in the host's /dev/shm, for an engine on the same host; tcp: the "
        "exporting engine serves the buffer once over its own HTTP, for an engine on another host",
    )


class SessionImport(WireModel):
    """POST /admin/import_session: a handle from another engine's export. ``handle`` is the transport's
    (a ShmHandle or a TcpHandle of engines/rollout/migration.py, told apart by its ``kind``); the
    gateway passes it through unread."""

    handle: dict[str, Any]
    wait: bool = Field(False, description="answer with the migrated request's completion once it ends")


class SessionImported(WireModel):
    """The answer of an import without wait (or of one whose session had no request in flight)."""

    session_id: str
    request_id: str | None = None


class EngineCounters(WireModel):
    """An engine's counters since it started (RolloutEngine.stats; GET /admin/stats carries them)."""

    prefilled_tokens: int = 0  # tokens run through a prefill forward
    cached_tokens: int = 0  # prompt tokens whose KV a first prefill reused (prefix-cache hits)
    decoded_tokens: int = 0  # tokens sampled (every output token)
    evictions: int = 0  # idle sessions whose KV the budget evicted
    migrations_in: int = 0
    migrations_out: int = 0
    recomputed_tokens: int = 0  # prefilled tokens whose KV this session had before (eviction, sleep, drop)
    steps: int = 0
    decode_steps: int = 0  # batched decode forwards
    batch_rebuilds: int = 0  # padded decode batch rebuilt (composition changed)
    max_running: int = 0  # most requests decoded in one forward
    weight_updates: int = 0


class EngineStatsReport(EngineCounters):
    """GET /admin/stats of an engine: who it is, what it serves, what it holds, and its counters."""

    engine_id: str | None = None
    policy_version: int | None = None
    asleep: bool = False
    weights_path: str | None = None
    """The weights it serves as given (None: those it started with): what a restarted sibling loads."""
    sessions: int = 0
    """Sessions it holds (with KV, or with their token history only after an eviction)."""
    waiting: int = 0
    """Requests queued for a batch row."""
    running: int = 0
    """Requests decoding now."""
    kv_bytes_served: int = 0
    """Bytes of exported KV it served to engines on other hosts (TcpTransport)."""
    kv_bytes_fetched: int = 0
    """Bytes of KV it fetched from engines on other hosts (TcpTransport)."""
    kv_tokens: int = 0
    """Cached tokens across all sessions, against ``kv_budget_tokens``."""
    kv_budget_tokens: int | None = None
    devices: DevicesReport | None = None
    """What its process got from its cell (engines/devices.py): visible GPUs, torch threads, cores."""


# the gateway's bodies ---------------------------------------------------------------------------------
class AddEngine(WireModel):
    """POST /admin/engines: connect an engine (again, if the gateway holds it dead)."""

    url: str
    engine_id: str | None = Field(None, pattern=ID_PATTERN)
    admin_token: str | None = None
    host: str | None = Field(None, description="the host it runs on (gateway EngineSpec.host)")
    trainer_url: str | None = Field(
        None, description="its cell's trainer replica (gateway EngineSpec.trainer_url)"
    )


class EngineAdded(WireModel):
    engine_id: str
    url: str
    model: str | None = None
    replaced: bool = False


class EngineActivated(WireModel):
    engine_id: str
    state: str = "active"


class EngineDeclaredDead(WireModel):
    """POST /admin/engines/<id>/dead: the gateway holds it dead (its host was lost, say)."""

    engine_id: str
    state: str = "dead"
    calls_aborted: int = 0
    """Its calls that were in flight: each re-runs on another engine from its recorded prompt."""
    sessions_lost: int = 0
    """Its sessions: each one's next call recomputes its context on another engine."""


class DeclareDead(WireModel):
    reason: str = Field("declared dead by an admin", max_length=500)


class DrainReport(WireModel):
    """POST /admin/engines/<id>/drain: its sessions moved to other engines, with their KV."""

    engine_id: str
    state: str
    sessions: int = 0
    """Sessions the engine held when the drain began."""
    moved_with_kv: int = 0
    """Of them, moved with their KV (those with a request in flight included)."""
    moved_mid_request: int = 0
    """Of those, moved with a request in flight, which the target finished."""
    rebound_without_kv: int = 0
    """Moved without KV (the engine held none for them): their next call recomputes it."""
    failed: list[str] = Field(default_factory=list)
    """One line per session that could not move (its next call recomputes its context elsewhere)."""
    seconds: float = 0.0


class FlushReport(WireModel):
    """POST /admin/flush: what the recorders wrote."""

    calls: int = 0
    executions: int = 0
    quarantined: int = 0
    """Records the store refused, kept aside with their reason."""
    manifests: list[str] = Field(default_factory=list)
    """The manifests committed: each makes a step's new parts visible."""


class GatewayCounters(WireModel):
    """The gateway's call counters (Gateway.stats)."""

    calls: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt ids taken from earlier calls (exactly as sent / generated)
    tokenized_prompt_tokens: int = 0  # prompt ids tokenized from text
    retokenized_assistant_messages: int = 0  # history the harness changed (or wrote), tokenized from text
    migrated_calls: int = 0
    stop_string_cuts: int = 0
    client_errors: int = 0


class RouterCounters(WireModel):
    """The router's counters (Router.stats)."""

    rerouted_calls: int = 0
    recomputed_tokens: int = 0
    engine_deaths: int = 0
    engines_unresponsive: int = 0  # of the deaths, engines that stopped answering their health checks
    drains: int = 0
    sessions_migrated: int = 0  # sessions whose KV moved
    requests_migrated: int = 0  # of them, mid-request
    sessions_rebound: int = 0  # moved without KV (the source held none for them)
    migration_failures: int = 0


class EngineView(WireModel):
    """One engine as the gateway sees it."""

    engine_id: str
    url: str
    host: str | None = Field(None, description="the host it runs on (its EngineSpec's, or its URL's)")
    trainer_url: str | None = Field(None, description="its cell's trainer replica, if it has one")
    state: str = Field(description="'active', 'draining' or 'dead'")
    sessions: int = 0
    """Sessions bound to it."""
    in_flight: int = 0
    """Requests the gateway has sent it and not yet got back."""
    calls: int = 0
    policy_version: int | None = None


class OverheadSummary(WireModel):
    """The gateway's own time per call (engine time excluded), over its recent calls."""

    samples: int = 0
    p50: float | None = None
    p99: float | None = None
    recent_ms: list[float] | None = Field(None, description="every recent sample (only with ?samples=true)")


class StoreAddress(WireModel):
    data_root: str
    campaign: str


class GatewayStatsReport(GatewayCounters, RouterCounters):
    """GET /admin/stats of the gateway: its counters and its router's, its engines, where it records."""

    record_errors: int = 0
    """Calls the recorders could not record (quarantined with their reason)."""
    executions: int = 0
    """Live executions."""
    finished_executions: int = 0
    store: StoreAddress | None = None
    """Where the gateway records (an execution may name another campaign of the same data root)."""
    step: int = 0
    gateway_overhead_ms: OverheadSummary = Field(default_factory=OverheadSummary)
    engines: list[EngineView] = Field(default_factory=list)
    sessions: int = 0


# the paths --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint(Generic[Answer]):
    """One admin route: its method, its path (a template where it names an engine or an execution) and
    the type its answer parses into (a model, a union of models, or dict for a body read unread)."""

    method: Literal["GET", "POST"]
    path: str
    answer: Any

    def url(self, base_url: str, **names: str) -> str:
        return base_url.rstrip("/") + self.path.format(**names)

    def request(
        self,
        base_url: str,
        token: str | None,
        body: BaseModel | None = None,
        params: dict[str, str] | None = None,
        **names: str,
    ) -> dict[str, Any]:
        """httpx ``request`` arguments of a call (``base_url`` "" for a client that has its own)."""
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        content = body.model_dump_json().encode() if body is not None else None
        url = self.url(base_url, **names)
        return {"method": self.method, "url": url, "content": content, "headers": headers, "params": params}

    def read(self, response: httpx.Response) -> Answer:
        """The answer, parsed; AdminError when the status says the call was refused."""
        if response.status_code != 200:
            raise AdminError(self.method, str(response.url), response.status_code, response.text)
        return _adapter(self.answer).validate_json(response.content)


@cache
def _adapter(answer: Any) -> TypeAdapter:
    return TypeAdapter(answer)


ENGINE_WEIGHTS = Endpoint[WeightsLoaded]("POST", "/admin/weights", WeightsLoaded)
ENGINE_SLEEP = Endpoint[SleepState]("POST", "/admin/sleep", SleepState)
ENGINE_WAKE = Endpoint[SleepState]("POST", "/admin/wake", SleepState)
EXPORT_SESSION = Endpoint[dict[str, Any]]("POST", "/admin/export_session", dict[str, Any])
IMPORT_SESSION = Endpoint[EngineCompletion | SessionImported](
    "POST", "/admin/import_session", EngineCompletion | SessionImported
)
ENGINE_STATS = Endpoint[EngineStatsReport]("GET", "/admin/stats", EngineStatsReport)

GATEWAY_STATS = Endpoint[GatewayStatsReport]("GET", "/admin/stats", GatewayStatsReport)
GATEWAY_FLUSH = Endpoint[FlushReport]("POST", "/admin/flush", FlushReport)
ADD_ENGINE = Endpoint[EngineAdded]("POST", "/admin/engines", EngineAdded)
DRAIN_ENGINE = Endpoint[DrainReport]("POST", "/admin/engines/{engine_id}/drain", DrainReport)
ACTIVATE_ENGINE = Endpoint[EngineActivated]("POST", "/admin/engines/{engine_id}/activate", EngineActivated)
ENGINE_DEAD = Endpoint[EngineDeclaredDead]("POST", "/admin/engines/{engine_id}/dead", EngineDeclaredDead)
REGISTER_EXECUTION = Endpoint[dict[str, Any]]("POST", "/admin/executions", dict[str, Any])
EXECUTION = Endpoint[dict[str, Any]]("GET", "/admin/executions/{execution_id}", dict[str, Any])
FINISH_EXECUTION = Endpoint[dict[str, Any]]("POST", "/admin/executions/{execution_id}/finish", dict[str, Any])
RELEASE_EXECUTION = Endpoint[dict[str, Any]](
    "POST", "/admin/executions/{execution_id}/release", dict[str, Any]
)


class AdminError(RuntimeError):
    """An admin call answered with an error status: ``status`` and the body (``text``)."""

    def __init__(self, method: str, url: str, status: int, text: str):
        super().__init__(f"{method} {url} answered {status}: {text[:300]}")
        self.status, self.text = status, text


# the client -------------------------------------------------------------------------------------------
class AdminClient:
    """The admin API of the gateway (engine management) and of every engine, over one httpx.Client:
    typed methods, bearer tokens (``gateway_token`` for the gateway, ``engine_token`` for engines).
    A refused call raises AdminError (it names the endpoint); an engine that cannot be reached raises
    httpx.TransportError, so a caller can tell a dead engine from a refusal."""

    def __init__(
        self,
        gateway_url: str | None = None,
        gateway_token: str | None = None,
        engine_token: str | None = None,
        *,
        timeout_s: float = 120.0,
    ):
        self.gateway_url = gateway_url
        self.gateway_token, self.engine_token = gateway_token, engine_token
        self.client = httpx.Client(timeout=timeout_s)

    def call(
        self,
        endpoint: Endpoint[Answer],
        base_url: str,
        token: str | None,
        body: BaseModel | None = None,
        *,
        params: dict[str, str] | None = None,
        **names: str,
    ) -> Answer:
        return endpoint.read(self.client.request(**endpoint.request(base_url, token, body, params, **names)))

    # the gateway --------------------------------------------------------------------------------------
    def gateway_stats(self, *, samples: bool = False) -> GatewayStatsReport:
        """``samples``: also every recent per-call overhead sample (gateway_overhead_ms.recent_ms)."""
        return self._gateway(GATEWAY_STATS, params={"samples": "true"} if samples else None)

    def add_engine(
        self,
        url: str,
        engine_id: str | None = None,
        admin_token: str | None = None,
        host: str | None = None,
        trainer_url: str | None = None,
    ) -> EngineAdded:
        body = AddEngine(
            url=url, engine_id=engine_id, admin_token=admin_token, host=host, trainer_url=trainer_url
        )
        return self._gateway(ADD_ENGINE, body)

    def drain(self, engine_id: str) -> DrainReport:
        return self._gateway(DRAIN_ENGINE, engine_id=engine_id)

    def activate(self, engine_id: str) -> EngineActivated:
        return self._gateway(ACTIVATE_ENGINE, engine_id=engine_id)

    def declare_dead(self, engine_id: str, reason: str = "declared dead by an admin") -> EngineDeclaredDead:
        """The gateway stops routing to the engine (its host was lost, say): its calls in flight re-run
        elsewhere, its sessions recompute there. Adding it (or another at its id) again revives it."""
        return self._gateway(ENGINE_DEAD, DeclareDead(reason=reason), engine_id=engine_id)

    def flush(self) -> FlushReport:
        return self._gateway(GATEWAY_FLUSH)

    # an engine ----------------------------------------------------------------------------------------
    def engine_stats(self, url: str) -> EngineStatsReport:
        return self.call(ENGINE_STATS, url, self.engine_token)

    def load_weights(
        self, url: str, path: str, version: int | None = None, *, drop_kv: bool = False
    ) -> WeightsLoaded:
        body = WeightsRequest(path=path, version=version, drop_kv=drop_kv)
        return self.call(ENGINE_WEIGHTS, url, self.engine_token, body)

    def sleep(self, url: str) -> SleepState:
        return self.call(ENGINE_SLEEP, url, self.engine_token)

    def wake(self, url: str, path: str, version: int | None = None) -> SleepState:
        return self.call(ENGINE_WAKE, url, self.engine_token, WakeRequest(path=path, version=version))

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _gateway(
        self,
        endpoint: Endpoint[Answer],
        body: BaseModel | None = None,
        *,
        params: dict[str, str] | None = None,
        **names: str,
    ) -> Answer:
        if self.gateway_url is None:
            raise ValueError(f"{endpoint.path} is the gateway's: this AdminClient was given no gateway_url")
        return self.call(endpoint, self.gateway_url, self.gateway_token, body, params=params, **names)
