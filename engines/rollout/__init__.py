"""Rollout engine: a torch-native inference engine for HF-format causal LMs (CPU, or CUDA when present).

Token ids at every boundary: a request is a session's full prompt as token ids; an output is the
sampled ids with the policy's raw logprob of each and the policy version that produced it.

    config.py     EngineConfig
    messages.py   SamplingParams, GenerateRequest, GenerateOutput
    engine.py     RolloutEngine: add_request / step / generate / abort, prefix KV cache per session,
                  continuous batching, LRU eviction, weight hot-swap, sleep / wake, export / import
    runner.py     ModelRunner: the HF model, prefill and batched-decode forwards, weight loading
    kv.py         KVRows (preallocated KV buffers handed to the model as its cache) and 4D masks
    sampling.py   per-request generators, temperature / top-k / top-p, raw logprobs
    state.py      Session, RequestState, EngineStats
    migration.py  SessionState, pack / unpack, KVTransport: ShmTransport, TorchIpcTransport, GlooTransport
    server.py     FastAPI app: vLLM-shaped /v1/completions with token ids, admin endpoints
    loop.py       EngineLoop: the background thread that steps the engine for the server

Run a server on a model folder:  python -m engines.rollout.server --model ./models/tiny --port 8100
"""

from engines.rollout.config import EngineConfig
from engines.rollout.engine import RolloutEngine
from engines.rollout.messages import GenerateOutput, GenerateRequest, SamplingParams
from engines.rollout.migration import GlooTransport, KVTransport, SessionState, ShmTransport

__all__ = [
    "EngineConfig",
    "GenerateOutput",
    "GenerateRequest",
    "GlooTransport",
    "KVTransport",
    "RolloutEngine",
    "SamplingParams",
    "SessionState",
    "ShmTransport",
]
