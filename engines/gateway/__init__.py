"""The gateway: an OpenAI-compatible proxy in front of the rollout engines that records every call
token-exactly, keeps each session on the engine holding its KV, moves sessions (with their KV) off an
engine that leaves rollout, and re-runs calls whose engine died.

An unmodified harness needs only a base_url and an api_key:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8200/x/<execution_id>/v1", api_key="<its key>")
    client.chat.completions.create(model="gyre-policy", messages=[...], tools=[...])

Pieces (each module's docstring has the details):
    config.py         GatewayConfig, LimitsConfig, EngineSpec
    protocol.py       OpenAI request models, response / stream-chunk builders
    engines/protocol.py  the engine wire (EngineCompletionRequest -> EngineCompletion), shared with the
                      engine server (engines/rollout/server.py)
    codec.py          ChatCodec: chat template -> text -> ids; output ids -> content + tool calls
    render.py         ChatMLRenderer (the project's template, natively and incrementally), TemplateRenderer
    context.py        SessionContext: token fidelity (earlier ids reused exactly, by message prefix)
    engine_client.py  EngineClient: HTTP to one engine (vLLM-compatible generation + our KV admin API)
    http.py           KeepAliveClient: the minimal HTTP/1.1 client of the generation hot path
    router.py         Router: connecting engines, session affinity, load-aware placement, drain with KV
                      migration, death
    registry.py       executions, their keys and agents
    limits.py         LimitsConfig's checks: prompt size (before tokenizing), per-execution caps
    stops.py          StopStrings: OpenAI stop strings on engines that stop at token ids
    recording.py      CallRecording: calls and executions through trajectory_store's Recorder, one FIFO thread
    service.py        Gateway: one call end to end (limits, context, router, stops, recording, answer)
    app.py            create_app: the FastAPI routes, auth, limits, OpenAI-style errors, SSE
    settings.py       the gateway process's options (from GatewayConfig), --config JSON, its environment
    __main__.py       python -m engines.gateway --model DIR --engine URL [--engine URL ...]
"""

from typing import TYPE_CHECKING

from engines import lazy_exports

# where each name lives; imported on first use, so that reading the config (the `gyre` parser does)
# does not import the tokenizer and the web stack
_HOMES = {
    "ChatCodec": "codec",
    "EngineSpec": "config",
    "GatewayConfig": "config",
    "LimitsConfig": "config",
    "Gateway": "service",
}
__all__ = [
    "ChatCodec",
    "EngineSpec",
    "Gateway",
    "GatewayConfig",
    "LimitsConfig",
]

if TYPE_CHECKING:
    from engines.gateway.codec import ChatCodec
    from engines.gateway.config import EngineSpec, GatewayConfig, LimitsConfig
    from engines.gateway.service import Gateway


__getattr__ = lazy_exports(__name__, _HOMES)
