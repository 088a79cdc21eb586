"""Router: which engine serves each session, and moving sessions between engines.

A session is one (execution, agent): session_id = "<execution_id>/<agent_id>", the engine's session id
too, so the engine's prefix cache holds its context between calls.

    engine, replaced = await router.connect(EngineSpec(url=...))      # probe it, read its id, add it
    route = router.route(session_id)
    result = await router.generate(route, request, known_tokens=...)  # EngineResult (an EngineCompletion)
    report = await router.drain(engine_id)                          # every session leaves that engine

Affinity and placement. A session's calls go to the engine it is bound to. A new session (or one whose
engine died) is placed on the active engine with the least load = bound sessions + requests in flight
(live sessions are the work to come in an agent workload; in-flight requests are the work now).

Drain (KV migration). The engine turns 'draining' (no new sessions). For each of its sessions, at once:
mark the session as moving (its next call waits), bind it to the least-loaded active engine, export
its KV from the source (/admin/export_session), import it on the target with wait=true. If a request of
that session was in flight, the export ends it on the source with finish_reason 'migrated' and the
import answers with its completion once the target finishes it: the call handler, which sent the
request and holds a future registered under its request id, awaits that instead. The harness sees one
normal response; the target prefills nothing of the migrated context.

Engine death. A request whose connection fails (refused, dropped mid-request) marks the engine dead:
all its sessions are unbound and flagged lost. The request, and later the next call of each lost
session, is re-sent with its full recorded prompt to another engine; that engine's prefilled tokens
that the session had already computed are counted as recomputed (RouterCounters.recomputed_tokens).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engines.admin import DrainReport, EngineDeclaredDead, EngineView, RouterCounters
from engines.gateway.config import EngineSpec
from engines.gateway.engine_client import EngineClient
from engines.gateway.errors import EngineDown, EngineRejected, GatewayError
from engines.protocol import EngineCompletion, EngineCompletionRequest


@dataclass(eq=False)
class SessionRoute:
    """One session's place: its engine, the lock that serializes its calls, whether it is moving."""

    session_id: str
    engine: EngineClient | None = None
    lost: bool = False  # its engine died with its KV: the next call recomputes the context
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # cleared while a drain moves it
    in_flight: str | None = None  # the request id the gateway is waiting on
    # request id -> its EngineCompletion on the engine it migrated to (None: it did not arrive there)
    migrations: dict[str, asyncio.Future] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.settled.set()


@dataclass
class EngineResult:
    response: EngineCompletion  # of the engine that finished the request
    engine: EngineClient
    engine_seconds: float  # time spent waiting on engines (requests and migrations)
    rerouted: bool  # re-run on another engine after its engine died
    migrated: bool  # its decode moved between engines (drain) while in flight
    recomputed_tokens: int


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # marks it retrieved: a migration nobody waited for is not an error


class Router:
    """Attributes: engines (id -> EngineClient), sessions (id -> SessionRoute), stats (RouterCounters)."""

    def __init__(self) -> None:
        self.engines: dict[str, EngineClient] = {}
        self.sessions: dict[str, SessionRoute] = {}
        self.stats = RouterCounters()

    # engines and sessions ---------------------------------------------------------------------------
    async def connect(
        self,
        spec: EngineSpec,
        *,
        admin_token: str | None = None,
        connect_timeout_s: float = 5.0,
        timeout_s: float | None = None,
    ) -> tuple[EngineClient, EngineClient | None]:
        """Connects to the engine at spec.url, reads its model and id, and adds it: (the engine, the engine
        it replaced). ``admin_token`` is the default of an engine whose spec gives none. 502 when the engine
        cannot be reached or answers out of protocol.

        One id per engine, everywhere (routing, /admin/stats, responses, records): the engine's own id
        (engines/protocol.py ModelCard.engine_id); ``spec.engine_id`` may name it only as it names itself
        (409 otherwise); an engine with no id of its own (vLLM) is spec.engine_id or 'engine-<n>'. An id
        already taken by a live engine at another URL is refused (409): it would take that engine's
        place; the same URL (a restart) or a dead engine is replaced."""
        engine = EngineClient(
            spec.engine_id or "pending",
            spec.url,
            admin_token=spec.admin_token or admin_token,
            connect_timeout_s=connect_timeout_s,
            timeout_s=timeout_s,
            host=spec.host,
        )
        engine.trainer_url = spec.trainer_url
        try:
            own_id = await engine.probe()
        except (EngineDown, EngineRejected) as exc:
            await engine.close()
            raise GatewayError(
                502, f"cannot add the engine at {spec.url}: {exc}", code="engine_unreachable"
            ) from exc
        try:
            engine.engine_id = self._engine_id(spec, own_id, engine.url)
        except GatewayError:
            await engine.close()
            raise
        old = self.add(engine)
        if old is not None:
            await old.close()
        return engine, old

    def _engine_id(self, spec: EngineSpec, own_id: str | None, url: str) -> str:
        if spec.engine_id is not None and own_id is not None and spec.engine_id != own_id:
            raise GatewayError(
                409,
                f"the engine at {spec.url} is {own_id!r}, not {spec.engine_id!r}: add it without engine_id, "
                f"or start it with --engine-id {spec.engine_id}",
                code="engine_id_mismatch",
            )
        engine_id = own_id or spec.engine_id
        if engine_id is None:
            n = len(self.engines)
            while f"engine-{n}" in self.engines:
                n += 1
            engine_id = f"engine-{n}"
        taken = self.engines.get(engine_id)
        if taken is not None and taken.state != "dead" and taken.url != url:
            raise GatewayError(
                409,
                f"engine id {engine_id!r} is taken by the live engine at {taken.url}: start the engine at "
                f"{spec.url} with its own --engine-id",
                code="engine_id_taken",
            )
        return engine_id

    def add(self, engine: EngineClient) -> EngineClient | None:
        """Adds (or replaces, e.g. a restarted dead engine) an engine; returns the replaced one."""
        old = self.engines.get(engine.engine_id)
        if old is not None:
            self.mark_dead(old, count=False)
        self.engines[engine.engine_id] = engine
        return old

    def route(self, session_id: str) -> SessionRoute:
        route = self.sessions.get(session_id)
        if route is None:
            route = self.sessions[session_id] = SessionRoute(session_id)
        return route

    def release(self, session_id: str) -> None:
        """Forgets a session (its execution finished); the engine's LRU eviction frees its KV."""
        route = self.sessions.pop(session_id, None)
        if route is not None and route.engine is not None:
            route.engine.sessions.discard(session_id)

    def place(self, exclude: EngineClient | None = None) -> EngineClient | None:
        candidates = [e for e in self.engines.values() if e.state == "active" and e is not exclude]
        return min(candidates, key=lambda e: e.load) if candidates else None

    def bind(self, route: SessionRoute, engine: EngineClient | None) -> None:
        if route.engine is not None:
            route.engine.sessions.discard(route.session_id)
        route.engine = engine
        if engine is not None:
            engine.sessions.add(route.session_id)

    def mark_dead(self, engine: EngineClient, *, count: bool = True) -> None:
        if engine.state != "dead" and count:
            self.stats.engine_deaths += 1
        engine.state = "dead"
        for session_id in list(engine.sessions):
            route = self.sessions.get(session_id)
            if route is not None and route.engine is engine:
                route.engine, route.lost = None, True
        engine.sessions.clear()

    async def watch(self, interval_s: float, misses: int, timeout_s: float) -> None:
        """Health checks, every ``interval_s``, of each engine with calls in flight; one that misses
        ``misses`` in a row is dead: its calls end (EngineDown) and re-run on another engine from
        their recorded prompts. A host cut off from the network or a frozen process breaks no
        connection, so without this its calls would wait for ever (engine_timeout_s is None by
        default: a call may decode for minutes). Runs until cancelled."""
        missed: dict[str, int] = {}
        while True:
            await asyncio.sleep(interval_s)
            watched = [e for e in self.engines.values() if e.state != "dead" and e.in_flight > 0]
            answers = await asyncio.gather(*(e.healthy(timeout_s) for e in watched))
            for engine, healthy in zip(watched, answers, strict=True):
                missed[engine.engine_id] = 0 if healthy else missed.get(engine.engine_id, 0) + 1
                if missed[engine.engine_id] >= misses:
                    missed.pop(engine.engine_id)
                    self.mark_dead(engine)
                    self.stats.engines_unresponsive += 1
                    engine.abort(f"engine {engine.engine_id} missed {misses} health checks in a row")

    def declare_dead(self, engine_id: str, reason: str) -> EngineDeclaredDead:
        """An admin says the engine is gone (its host lost): as if it missed its health checks."""
        engine = self._engine(engine_id)
        report = EngineDeclaredDead(
            engine_id=engine_id, calls_aborted=engine.in_flight, sessions_lost=len(engine.sessions)
        )
        self.mark_dead(engine)
        engine.abort(f"engine {engine_id}: {reason}")
        return report

    def activate(self, engine_id: str) -> None:
        engine = self._engine(engine_id)
        if engine.state == "dead":
            raise GatewayError(409, f"engine {engine_id} is dead: add it again with POST /admin/engines")
        engine.state = "active"

    # calls ------------------------------------------------------------------------------------------
    async def generate(
        self, route: SessionRoute, request: EngineCompletionRequest, known_tokens: int = 0
    ) -> EngineResult:
        """Runs one request of ``route``'s session (the caller holds route.lock), wherever it must go.
        ``request`` has its request_id (a retry elsewhere appends -retry<n>)."""
        base_id = request.request_id
        rerouted = migrated = False
        waited = 0.0
        failures: list[str] = []
        for attempt in range(len(self.engines) + 1):
            await route.settled.wait()
            engine = route.engine
            if engine is None or engine.state == "dead":
                rerouted = rerouted or route.lost or engine is not None
                engine = self.place()
                if engine is None:
                    detail = f" ({'; '.join(failures)})" if failures else ""
                    raise GatewayError(503, f"no rollout engine is available{detail}", code="no_engine")
                self.bind(route, engine)
            request_id = base_id if attempt == 0 else f"{base_id}-retry{attempt}"
            route.in_flight, engine.in_flight = request_id, engine.in_flight + 1
            start = time.perf_counter()
            try:
                response = await engine.generate(request.model_copy(update={"request_id": request_id}))
            except EngineDown as exc:
                failures.append(str(exc))
                self.mark_dead(engine)
                rerouted = True
                continue
            finally:
                waited += time.perf_counter() - start
                engine.in_flight -= 1
                route.in_flight = None
            future = route.migrations.pop(request_id, None)
            if response.choice.finish_reason == "migrated":
                start = time.perf_counter()
                try:
                    moved = await future if future is not None else None
                except Exception as exc:  # the move failed (target died...): re-run from the full prompt
                    failures.append(str(exc))
                    moved = None
                finally:
                    waited += time.perf_counter() - start
                if moved is None:
                    rerouted = True
                    continue
                response, engine, migrated = moved, route.engine or engine, True
            recomputed = 0
            if rerouted:
                recomputed = min(response.prefilled_tokens(), known_tokens)
                self.stats.rerouted_calls += 1
                self.stats.recomputed_tokens += recomputed
            route.lost = False
            return EngineResult(response, engine, waited, rerouted, migrated, recomputed)
        raise GatewayError(503, f"every rollout engine failed this request: {'; '.join(failures)}")

    # drain ------------------------------------------------------------------------------------------
    async def drain(self, engine_id: str) -> DrainReport:
        """Moves every session of the engine to other engines, with its KV and any request in flight."""
        source = self._engine(engine_id)
        if source.state == "dead":
            raise GatewayError(409, f"engine {engine_id} is dead: nothing to drain")
        routes = [self.sessions[s] for s in sorted(source.sessions) if s in self.sessions]
        if routes and self.place(exclude=source) is None:
            raise GatewayError(409, f"cannot drain {engine_id}: no other active engine can take its sessions")
        source.state = "draining"  # with no session to move, even the last engine may go (a whole pool
        self.stats.drains += 1  # that turns to training between steps)
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(self._move(r, source) for r in routes), return_exceptions=True)
        errors = [
            f"{r.session_id}: {o}" for r, o in zip(routes, outcomes, strict=True) if isinstance(o, Exception)
        ]
        return DrainReport(
            engine_id=engine_id,
            state=source.state,
            sessions=len(routes),
            moved_with_kv=sum(o in ("kv", "request") for o in outcomes),
            moved_mid_request=sum(o == "request" for o in outcomes),
            rebound_without_kv=sum(o == "rebound" for o in outcomes),
            failed=errors,
            seconds=round(time.perf_counter() - start, 4),
        )

    async def _move(self, route: SessionRoute, source: EngineClient) -> str:
        target = self.place(exclude=source)
        if target is None:
            raise GatewayError(409, "no active engine left to take the session")
        route.settled.clear()
        future = None
        if route.in_flight is not None:
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(_consume)
            route.migrations[route.in_flight] = future
        self.bind(route, target)
        try:
            # between hosts the target fetches the KV from the source over TCP; on one host, /dev/shm
            transport = "shm" if source.host == target.host else "tcp"
            handle = await source.export_session(route.session_id, transport)
            if handle is None:
                outcome, completion = "rebound", None
                self.stats.sessions_rebound += 1
            else:
                answer = await target.import_session(handle, wait=True)
                completion = answer if isinstance(answer, EngineCompletion) else None
                outcome = "request" if completion is not None else "kv"
                self.stats.sessions_migrated += 1
                self.stats.requests_migrated += outcome == "request"
            if future is not None and not future.done():
                future.set_result(completion)
            return outcome
        except Exception as exc:
            self.stats.migration_failures += 1
            if future is not None and not future.done():
                future.set_exception(exc)
            if isinstance(exc, EngineDown) and exc.engine_id in self.engines:
                self.mark_dead(self.engines[exc.engine_id])
            if route.engine is target:  # the KV did not arrive: the next call recomputes it
                self.bind(route, None)
                route.lost = True
            raise
        finally:
            route.settled.set()

    # stats ------------------------------------------------------------------------------------------
    def views(self) -> list[EngineView]:
        """Every engine as /admin/stats shows it."""
        return [
            EngineView(
                engine_id=e.engine_id,
                url=e.url,
                host=e.host,
                trainer_url=e.trainer_url,
                state=e.state,
                sessions=len(e.sessions),
                in_flight=e.in_flight,
                calls=e.calls,
                policy_version=e.policy_version,
            )
            for e in self.engines.values()
        ]

    def _engine(self, engine_id: str) -> EngineClient:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise GatewayError(
                404, f"no engine {engine_id!r}; known: {sorted(self.engines)}", code="engine_not_found"
            )
        return engine
