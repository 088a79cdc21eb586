"""The vLLM engine: our engine API in front of vLLM's own server (process.py), so the gateway, the
campaign and the scheduler drive a vLLM engine as they drive ours (engines/rollout/server.py).

    GYRE_ROLLOUT_ADMIN_TOKEN=... python -m engines.vllm --model ./policy --port 8100
        (starts vLLM in its own environment, config.py says how it is found; prints one line when ready)

What each endpoint does with vLLM:
    POST /v1/completions   passed to vLLM's /v1/completions (token ids in; token ids, the sampled tokens'
                           raw logprobs, prefix-cache hits out), answered with our ``gyre`` extension: the
                           engine id, the policy version of every output token, cached and prefilled tokens
    GET  /v1/models        the served model with this engine's id and max_model_len
    POST /admin/weights    vLLM's reload_weights (collective_rpc) from the file or folder; drop_kv resets
                           the prefix cache
    POST /admin/sleep      vLLM's /sleep at level 2 (a GPU frees weights and KV); a CPU build has no sleep
                           mode (vLLM pauses its scheduler and keeps its memory: docs/engines.md has the
                           measured cost)
    POST /admin/wake       /wake_up of the weights, reload_weights of the new version, /wake_up of the KV
    GET  /admin/stats      our counters of what passed through, with vLLM's queue (/metrics)
    POST /admin/export_session  404: vLLM keeps no session state we can hand over. The gateway then
                           rebinds the session and its next call prefills the recorded context on the
                           target (exact; the target's prefix cache serves what it already holds)

Versions are exact: a weight swap, a sleep and a wake wait for the requests in flight to end and hold
new ones back until done (``Gate``), so every answer was produced by one version, the one it records.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import JSONResponse, Response

from engines import admin
from engines.admin import (
    EngineCounters,
    EngineStatsReport,
    SleepState,
    WakeRequest,
    WeightsLoaded,
    WeightsRequest,
)
from engines.auth import add_engine_routes, bearer_guard, error_response
from engines.devices import settings as devices
from engines.net import free_port, serve_http
from engines.options import parse_config
from engines.protocol import EngineCompletion, EngineCompletionRequest, GyreChoice, ModelCard
from engines.vllm import settings
from engines.vllm.config import VllmServerConfig
from engines.vllm.process import VllmExited, VllmProcess
from engines.vllm.weights import is_tied, policy_version_of, serving_folder, weights_folder


class Gate:
    """Requests pass while it is open; ``exclusive()`` closes it, waits for those in flight, and opens it
    again when its block ends (or leaves it closed: sleep)."""

    def __init__(self) -> None:
        self.condition = asyncio.Condition()
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed = False

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        async with self.condition:
            await self.condition.wait_for(lambda: not self.closed)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            yield
        finally:
            async with self.condition:
                self.in_flight -= 1
                self.condition.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self, *, reopen: bool = True) -> AsyncIterator[None]:
        async with self.condition:
            await self.condition.wait_for(lambda: not self.closed)  # one exclusive holder at a time
            self.closed = True
            await self.condition.wait_for(lambda: self.in_flight == 0)
        try:
            yield
        finally:
            if reopen:
                await self.open()

    async def open(self) -> None:
        async with self.condition:
            self.closed = False
            self.condition.notify_all()


def queue_of(metrics: str) -> tuple[int, int]:
    """(running, waiting) requests from vLLM's Prometheus text."""

    def gauge(name: str) -> int:
        found = re.search(rf"^vllm:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", metrics, re.MULTILINE)
        return int(float(found.group(1))) if found else 0

    return gauge("num_requests_running"), gauge("num_requests_waiting")


def create_app(config: VllmServerConfig) -> FastAPI:
    engine_id = config.own_id()
    guard = bearer_guard(config.admin_token)
    gate = Gate()
    counters = EngineCounters()
    state: dict = {"version": 0, "path": None, "asleep": False, "max_model_len": None}
    scratch = Path(tempfile.mkdtemp(prefix=f"gyre-vllm-{engine_id}-"))
    tied = is_tied(config.model)
    child: dict[str, VllmProcess] = {}
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=None)
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        served = config.model_copy(update={"model": serving_folder(config.model, scratch)})
        process = child["vllm"] = VllmProcess(served, free_port())
        watcher = None
        try:
            try:
                seconds = await process.wait_healthy(client)
            except VllmExited as exc:
                # once more, on a fresh port: the port picked may have been taken before vLLM bound it
                print(f"{exc}: starting vLLM once more on another port", file=sys.stderr, flush=True)
                process = child["vllm"] = VllmProcess(served, free_port())
                seconds = await process.wait_healthy(client)
            models = (await client.get(f"{process.url}/v1/models")).json()
            state["max_model_len"] = models["data"][0].get("max_model_len")
            watcher = asyncio.create_task(_watch(process))
            print(
                f"gyre vllm engine {engine_id} on http://{config.host}:{config.port}: model {config.model} "
                f"(vLLM {process.url}, started in {seconds:.1f} s), policy version 0, max_model_len "
                f"{state['max_model_len']}; admin API {'on' if config.admin_token else 'off'}",
                file=sys.stderr,
                flush=True,
            )
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            process.stop()
            await client.aclose()
            shutil.rmtree(scratch, ignore_errors=True)

    async def _watch(process: VllmProcess) -> None:
        """vLLM died: so does the adapter, and whoever supervises engines starts both again."""
        while process.process.poll() is None:
            await asyncio.sleep(1.0)
        print(f"vLLM exited with {process.process.returncode}: the engine stops", file=sys.stderr, flush=True)
        os._exit(1)

    async def vllm(method: str, path: str, **kwargs) -> httpx.Response:
        response = await client.request(method, child["vllm"].url + path, **kwargs)
        if response.status_code >= 400:
            raise HTTPException(
                502, f"vLLM {method} {path} answered {response.status_code}: {response.text[:300]}"
            )
        return response

    async def reload(path: str) -> None:
        folder = weights_folder(path, scratch, tied=tied)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
        await vllm("POST", "/collective_rpc", json=rpc)
        counters.weight_updates += 1
        old, state["folder"] = state.get("folder"), folder
        if old and old != folder and Path(old).parent == scratch:  # the last version's links and head
            shutil.rmtree(old, ignore_errors=True)

    def version_of(path: str, version: int | None) -> int:
        try:
            found = policy_version_of(path)
        except (FileNotFoundError, ValueError) as exc:
            raise HTTPException(400, str(exc)) from exc
        if version is None and found is None:
            raise HTTPException(400, f"{path} has no 'version' metadata: pass version")
        return version if version is not None else found  # type: ignore[return-value]

    app = FastAPI(title="gyrerl vLLM engine", lifespan=lifespan)

    def card() -> ModelCard:
        return ModelCard(
            id=config.served_model_name,
            created=int(time.time()),
            max_model_len=state["max_model_len"],
            engine_id=engine_id,
            owned_by="vllm",
        )

    add_engine_routes(app, card)

    @app.post("/v1/completions")
    async def completions(body: EngineCompletionRequest):
        if body.n != 1 or body.stream or body.echo:
            return error_response(400, "n > 1, stream and echo are not supported")
        if not body.prompt or not isinstance(body.prompt[0], int):
            return error_response(400, "prompt must be one non-empty list of token ids")
        request = body.model_dump(exclude_none=True)
        # ignore_eos: like our engine, stop only at the stop_token_ids the caller sends (the gateway sends
        # the template's end ids), not at whatever the model folder calls its EOS
        request.update(
            model=config.served_model_name,
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            ignore_eos=True,
        )
        async with gate.request():
            version = state["version"]
            response = await client.post(f"{child['vllm'].url}/v1/completions", json=request)
        if response.status_code >= 400:
            return Response(response.content, status_code=response.status_code, media_type="application/json")
        completion = EngineCompletion.model_validate_json(response.content)
        choice, usage = completion.choice, completion.usage
        prompt_tokens = usage.prompt_tokens if usage else len(body.prompt)
        prefilled = completion.prefilled_tokens()  # the prompt less vLLM's prefix-cache hits
        cached = prompt_tokens - prefilled
        choice.gyre = GyreChoice(
            request_id=body.request_id,
            session_id=body.session_id,
            policy_versions=[version] * len(choice.token_ids),
            engine_id=engine_id,
            cached_prompt_tokens=cached,
            prefilled_tokens=prefilled,
        )
        if choice.logprobs is not None:
            choice.logprobs.top_logprobs = None  # vLLM repeats the sampled token's logprob there
        counters.prefilled_tokens += prefilled
        counters.cached_tokens += cached
        counters.decoded_tokens += len(choice.token_ids)
        counters.steps += 1
        counters.max_running = gate.max_in_flight
        return Response(completion.model_dump_json(exclude_none=True), media_type="application/json")

    @app.post(admin.ENGINE_WEIGHTS.path, dependencies=[Depends(guard)])
    async def weights(body: WeightsRequest) -> WeightsLoaded:
        version = version_of(body.path, body.version)
        async with gate.exclusive():
            await reload(body.path)
            if body.drop_kv:
                await vllm("POST", "/reset_prefix_cache")
            state.update(version=version, path=body.path)
        return WeightsLoaded(policy_version=version)

    @app.post(admin.ENGINE_SLEEP.path, dependencies=[Depends(guard)])
    async def sleep() -> SleepState:
        if not state["asleep"]:
            async with gate.exclusive(reopen=False):
                await vllm("POST", "/sleep", params={"level": "2", "mode": "wait"})
                state["asleep"] = True
        return SleepState(asleep=True, policy_version=state["version"])

    @app.post(admin.ENGINE_WAKE.path, dependencies=[Depends(guard)])
    async def wake(body: WakeRequest) -> SleepState:
        version = version_of(body.path, body.version)
        if state["asleep"]:
            await vllm("POST", "/wake_up", params={"tags": "weights"})
            await reload(body.path)  # level 2 discarded the weights: load this version's
            await vllm("POST", "/wake_up", params={"tags": "kv_cache"})
            await vllm("POST", "/reset_prefix_cache")
            state.update(version=version, path=body.path, asleep=False)
            await gate.open()
        elif version != state["version"]:
            async with gate.exclusive():
                await reload(body.path)
                await vllm("POST", "/reset_prefix_cache")
                state.update(version=version, path=body.path)
        return SleepState(asleep=False, policy_version=state["version"])

    @app.post(admin.EXPORT_SESSION.path, dependencies=[Depends(guard)])
    async def export_session() -> JSONResponse:
        return error_response(
            404, "a vLLM engine holds no session to export: the gateway recomputes it on the target"
        )

    @app.post(admin.IMPORT_SESSION.path, dependencies=[Depends(guard)])
    async def import_session() -> JSONResponse:
        return error_response(501, "a vLLM engine imports no session KV (no KV connector configured)")

    @app.get(admin.ENGINE_STATS.path, dependencies=[Depends(guard)])
    async def stats() -> EngineStatsReport:
        _, waiting = queue_of((await vllm("GET", "/metrics")).text)
        # running: what this front has sent and not had answered, less vLLM's queue. vLLM's own running gauge
        # is refreshed by its stats loop and can miss a short call entirely
        running = max(gate.in_flight - waiting, 0)
        return EngineStatsReport(
            engine_id=engine_id,
            policy_version=state["version"],
            asleep=state["asleep"],
            weights_path=state["path"],
            running=running,
            waiting=waiting,
            devices=devices.report(torch_threads=False),
            **counters.model_dump(),
        )

    return app


def build_parser() -> argparse.ArgumentParser:
    from engines.options import add_config_file_option, add_config_options

    parser = argparse.ArgumentParser(prog="python -m engines.vllm", description=__doc__.split("\n")[0])
    add_config_file_option(parser, VllmServerConfig)
    add_config_options(parser, VllmServerConfig, skip={"extra_args"}, env={"admin_token": settings.ADMIN_ENV})
    return parser


def config_from_args(args: argparse.Namespace) -> VllmServerConfig:
    from engines.options import build_config

    return build_config(VllmServerConfig, args, layers=[settings.env_defaults()])


def serve(config: VllmServerConfig) -> None:
    devices.enter_cell(torch_threads=False)  # its cell's cores: vLLM inherits them (process.py)
    serve_http(create_app(config), config.host, config.port)


def main(argv: list[str] | None = None) -> None:
    serve(parse_config(build_parser(), config_from_args, argv))
