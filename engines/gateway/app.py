"""The gateway's HTTP front (FastAPI). `create_app(gateway)`; run it with uvicorn (see __main__.py).

OpenAI-compatible, per execution (Authorization: Bearer <the execution's api_key>):
    POST /x/<execution_id>/v1/chat/completions                    the main agent
    POST /x/<execution_id>/agents/<agent_id>/v1/chat/completions  a sub-agent (one engine session each)
    POST .../v1/completions, GET .../v1/models                    on both prefixes
    POST /v1/chat/completions, /v1/completions, GET /v1/models    the key alone names the execution;
                                                                  X-Gyre-Agent (or gyre_agent) a sub-agent
Role of a call: header X-Gyre-Role (or extra_body gyre_role): main, sub, main_summary, sub_summary;
default "main" for the main agent, "sub" for sub-agents.

Admin (Authorization: Bearer <admin_token>; 403 when the gateway has none, 401 when wrong):
    POST /admin/executions {execution_id, problem_id, group_id, step, harness}
                                   -> {base_url, agent_base_url, api_key, step, created}
    GET  /admin/executions/<id>    POST /admin/executions/<id>/finish {status, reward, reward_source, snapshot_uri}
    POST /admin/executions/<id>/release   (its ending is recorded by another gateway: environments/gateways.py)
    POST /admin/engines {url, engine_id?, admin_token?}   POST /admin/engines/<id>/drain | /activate
    GET  /admin/stats[?samples=true]   POST /admin/flush
GET /health needs nothing.

Errors are OpenAI-shaped (errors.py): 400 malformed JSON or fields, unknown role, n > 1, prompt above
max_prompt_chars (before tokenizing) or max_prompt_tokens (code context_length_exceeded), an execution
past its calls / agents / tokens limits (code execution_limit_exceeded); 401 missing/wrong key; 404
unknown or finished execution, unknown route; 413 body above max_request_bytes (checked against
Content-Length first, then while reading); 422 a finish whose reward is not finite or outside [0, 1];
503 no engine left. stream=true is emulated: the completion is computed whole, then
sent as SSE chunks (role, content, tool calls, finish, usage) and [DONE]; the engine API has no token
streaming.

Start and access log: create_app(gateway, banner=True) prints one line once the engines are added
(address, engines, data root, campaign, step); with GatewayConfig.access_log (--access-log, off by default)
every request is logged as one line (OverheadTimer below), on stderr when run by __main__.py.

Timing: a small ASGI wrapper measures each completion request from arrival to the last body byte sent,
minus the time spent waiting on engines: gateway.overhead_ms (p50/p99 in /admin/stats).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engines.admin import (
    ACTIVATE_ENGINE,
    ADD_ENGINE,
    DRAIN_ENGINE,
    ENGINE_DEAD,
    EXECUTION,
    FINISH_EXECUTION,
    GATEWAY_FLUSH,
    GATEWAY_STATS,
    REGISTER_EXECUTION,
    RELEASE_EXECUTION,
    AddEngine,
    DeclareDead,
    DrainReport,
    EngineActivated,
    EngineAdded,
    EngineDeclaredDead,
    FlushReport,
    GatewayStatsReport,
)
from engines.gateway.errors import GatewayError, error_body
from engines.gateway.protocol import (
    ChatCompletionRequest,
    FinishExecution,
    RegisterExecution,
    SamplingFields,
    TextCompletionRequest,
    call_role,
    chat_chunks,
    completion_chunks,
    sse,
)
from engines.gateway.registry import Execution
from engines.gateway.service import Gateway
from engines.protocol import ID_PATTERN
from trajectory_store.schema import Role

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("engines.gateway.access")
Body = TypeVar("Body", bound=BaseModel)
_ID = re.compile(ID_PATTERN)


def create_app(gateway: Gateway, *, banner: bool = False) -> FastAPI:
    """The app (wrapped in OverheadTimer). ``banner``: print gateway.banner() on stderr once started."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        if banner:
            print(gateway.banner(), file=sys.stderr, flush=True)
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="gyrerl gateway", lifespan=lifespan)
    app.state.gateway = gateway
    limit = gateway.config.limits.max_request_bytes

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        if exc.status < 500:
            gateway.stats.client_errors += 1
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, _describe(exc.errors())), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal gateway error: {exc!r}"), status_code=500)

    async def read(request: Request, model: type[Body]) -> Body:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise GatewayError(
                413,
                f"request body of {declared} bytes is above the {limit}-byte limit",
                code="request_too_large",
            )
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise GatewayError(
                    413, f"request body is above the {limit}-byte limit", code="request_too_large"
                )
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            data = _lenient_json(raw)  # NaN / Infinity, as Python's json writes them
            if data is None:
                raise GatewayError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(data, dict):
            raise GatewayError(400, "the body must be a JSON object", code="invalid_json")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors()
            param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
            raise GatewayError(400, _describe(errors), param=param) from exc

    async def admin(request: Request) -> None:
        token = gateway.config.admin_token
        if token is None:
            raise GatewayError(403, "the admin API is off: start the gateway with an admin token")
        if not secrets.compare_digest(_bearer(request).encode(), token.encode()):
            raise GatewayError(401, "missing or wrong admin bearer token", code="invalid_api_key")

    def caller(
        request: Request, execution_id: str | None, agent_id: str | None, body: Any
    ) -> tuple[Execution, str, Role]:
        if execution_id is None:
            execution = gateway.registry.by_key(_bearer(request))
        else:
            execution = gateway.registry.authenticate(execution_id, _bearer(request) or None)
        if agent_id is None:
            agent_id = request.headers.get("x-gyre-agent") or getattr(body, "gyre_agent", None) or "main"
        if not _ID.match(agent_id):
            raise GatewayError(
                400, f"bad agent id {agent_id!r}: letters, digits and ._:@+- only", param="agent_id"
            )
        role = request.headers.get("x-gyre-role") or getattr(body, "gyre_role", None)
        return execution, agent_id, call_role(role, agent_id)

    # OpenAI-compatible ------------------------------------------------------------------------------
    def openai_route(
        model: type[SamplingFields],
        call: Callable[..., Awaitable[tuple[dict[str, Any], float]]],
        chunks: Callable[[dict[str, Any], bool], list[dict[str, Any]]],
    ) -> Callable[..., Awaitable[Response]]:
        """The handler of one OpenAI endpoint: read ``model``, ``call`` the gateway, answer (or stream
        the answer as ``chunks``)."""

        async def handle(
            request: Request, execution_id: str | None = None, agent_id: str | None = None
        ) -> Response:
            body = await read(request, model)
            execution, agent, role = caller(request, execution_id, agent_id, body)
            completion, engine_s = await call(execution, agent, role, body)
            request.state.gyre_engine_s = engine_s
            if body.stream:
                include = bool(body.stream_options and body.stream_options.include_usage)
                return _stream(sse(chunks(completion, include)))
            return Response(orjson.dumps(completion), media_type="application/json")

        return handle

    chat = openai_route(ChatCompletionRequest, gateway.chat, chat_chunks)
    completions = openai_route(TextCompletionRequest, gateway.complete, completion_chunks)

    async def models(request: Request, execution_id: str | None = None, agent_id: str | None = None) -> dict:
        token = _bearer(request)
        admin_token = gateway.config.admin_token
        if execution_id is not None:
            gateway.registry.authenticate(execution_id, token or None)
        elif not (admin_token and secrets.compare_digest(token.encode(), admin_token.encode())):
            gateway.registry.by_key(token)
        card = {"id": gateway.config.served_model_name, "object": "model", "created": 0, "owned_by": "gyrerl"}
        return {"object": "list", "data": [card]}

    for prefix in ("", "/x/{execution_id}", "/x/{execution_id}/agents/{agent_id}"):
        app.add_api_route(f"{prefix}/v1/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])

    @app.get("/health")
    async def health() -> dict:
        return {}

    # admin: the execution API (environments/gateway_admin.py is its client) and engine management
    # (engines/admin.py: the paths and the models); every route checks the admin token first
    api = APIRouter(dependencies=[Depends(admin)])

    @api.post(REGISTER_EXECUTION.path)
    async def register(request: Request) -> dict:
        return await gateway.register_execution(await read(request, RegisterExecution))

    @api.get(EXECUTION.path)
    async def execution_info(execution_id: str) -> dict:
        execution = gateway.registry.get(execution_id)
        return {
            "execution_id": execution.execution_id,
            "step": execution.step,
            "calls": execution.calls,
            "agents": {
                a.agent_id: {"calls": a.calls, "engine": a.route.engine.engine_id if a.route.engine else None}
                for a in execution.agents.values()
            },
        }

    @api.post(FINISH_EXECUTION.path)
    async def finish(request: Request, execution_id: str) -> dict:
        return await gateway.finish_execution(execution_id, await read(request, FinishExecution))

    @api.post(RELEASE_EXECUTION.path)
    async def release(execution_id: str) -> dict:
        return await gateway.release_execution(execution_id)

    @api.post(ADD_ENGINE.path)
    async def add_engine(request: Request) -> EngineAdded:
        return await gateway.add_engine(await read(request, AddEngine))

    @api.post(DRAIN_ENGINE.path)
    async def drain(engine_id: str) -> DrainReport:
        return await gateway.router.drain(engine_id)

    @api.post(ENGINE_DEAD.path)
    async def declare_dead(request: Request, engine_id: str) -> EngineDeclaredDead:
        return gateway.router.declare_dead(engine_id, (await read(request, DeclareDead)).reason)

    @api.post(ACTIVATE_ENGINE.path)
    async def activate(engine_id: str) -> EngineActivated:
        gateway.router.activate(engine_id)
        return EngineActivated(engine_id=engine_id)

    @api.get(GATEWAY_STATS.path)
    async def stats(samples: bool = False) -> GatewayStatsReport:
        return gateway.describe(samples=samples)

    @api.post(GATEWAY_FLUSH.path)
    async def flush() -> FlushReport:
        return await gateway.flush()

    app.include_router(api)
    return OverheadTimer(app, gateway)  # type: ignore[return-value]


class OverheadTimer:
    """ASGI wrapper: per completion request, arrival to last byte sent minus the engine time the handler
    reported (request.state.gyre_engine_s), into gateway.overhead_ms. With config.access_log, one line per
    HTTP request on the ``engines.gateway.access`` logger (INFO):

        127.0.0.1:50312 "POST /x/e1/v1/chat/completions" 200 41.2 ms (engine 38.9 ms)

    (client, method and path, status, milliseconds to the last byte, engine time for completions; never
    a header, a key or a body). Other paths pass straight through when the access log is off."""

    def __init__(self, app: FastAPI, gateway: Gateway):
        self.app = app
        self.gateway = gateway
        self.state = app.state  # tests and callers reach app.state.gateway through the wrapper

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access_log = self.gateway.config.access_log
        timed = scope["path"].endswith("completions")
        if not (timed or access_log):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets when the app fails before answering

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status if access_log else send)
        finally:
            seconds = time.perf_counter() - start
            engine_s = scope.get("state", {}).get("gyre_engine_s")
            if timed and engine_s is not None:
                self.gateway.overhead_ms.append((seconds - engine_s) * 1e3)
            if access_log:
                client = scope.get("client") or ("-", 0)
                line = f'{client[0]}:{client[1]} "{scope["method"]} {scope["path"]}" {status} {seconds * 1e3:.1f} ms'
                if engine_s is not None:
                    line += f" (engine {engine_s * 1e3:.1f} ms)"
                access_logger.info(line)


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _stream(payload: bytes) -> StreamingResponse:
    async def body():
        for event in payload.split(b"\n\n")[:-1]:
            yield event + b"\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _lenient_json(raw: bytes | bytearray) -> Any:
    """A small body that strict JSON refused, parsed by Python's json (which reads NaN and Infinity, so
    a reward of NaN gets a clear 422 from the check that follows instead of a parse error); None when it
    is not JSON either. Large bodies are not retried: a slow parse of a hostile body stays off the loop."""
    if len(raw) > 65_536:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _describe(errors: list[Any]) -> str:
    parts = []
    for error in errors[:3]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "invalid request: " + "; ".join(parts)
