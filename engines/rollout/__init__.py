"""Rollout engine: a torch-native inference engine for HF-format causal LMs (CPU, or CUDA when present).

Token ids at every boundary: a request is a session's full prompt as token ids; an output is the
sampled ids with the policy's raw logprob of each and the policy version that produced it.

    config.py     EngineConfig; EngineServerConfig (the server process: address, admin token, engine id)
    messages.py   SamplingParams, GenerateRequest, GenerateOutput
    engine.py     RolloutEngine: add_request / step / generate / abort, prefix KV cache per session,
                  continuous batching, LRU eviction, weight hot-swap, sleep / wake, export / import
    runner.py     ModelRunner: the HF model, prefill and batched-decode forwards, weight loading
    kv.py         KVRows (preallocated KV buffers handed to the model as its cache) and 4D masks
    sampling.py   per-request generators, temperature / top-k / top-p, raw logprobs
    state.py      Session, RequestState (the counters: engines/admin.py EngineCounters)
    migration.py  SessionState, pack / unpack, KVTransport: ShmTransport, TorchIpcTransport, GlooTransport
    server.py     FastAPI app: vLLM-shaped /v1/completions with token ids, admin endpoints
    settings.py   the server process's options (from EngineServerConfig), --config JSON, its environment
    loop.py       EngineLoop: the background thread that steps the engine for the server

Run a server on a model folder:  python -m engines.rollout.server --model ./models/tiny --port 8100
"""

from typing import TYPE_CHECKING

from engines import lazy_exports

# where each name lives; imported on first use, so that reading a config (the `gyre` parser does)
# does not import torch
_HOMES = {
    "EngineConfig": "config",
    "EngineServerConfig": "config",
    "RolloutEngine": "engine",
    "GenerateOutput": "messages",
    "GenerateRequest": "messages",
    "SamplingParams": "messages",
    "GlooTransport": "migration",
    "KVTransport": "migration",
    "SessionState": "migration",
    "ShmTransport": "migration",
}
__all__ = [
    "EngineConfig",
    "EngineServerConfig",
    "GenerateOutput",
    "GenerateRequest",
    "GlooTransport",
    "KVTransport",
    "RolloutEngine",
    "SamplingParams",
    "SessionState",
    "ShmTransport",
]

if TYPE_CHECKING:
    from engines.rollout.config import EngineConfig, EngineServerConfig
    from engines.rollout.engine import RolloutEngine
    from engines.rollout.messages import GenerateOutput, GenerateRequest, SamplingParams
    from engines.rollout.migration import GlooTransport, KVTransport, SessionState, ShmTransport


__getattr__ = lazy_exports(__name__, _HOMES)
