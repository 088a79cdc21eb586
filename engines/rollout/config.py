"""Typed configuration of one rollout engine (DESIGN.md section 3: each layer owns its config).

EngineConfig        what one RolloutEngine may hold and how it runs
EngineServerConfig  the server process around it (server.py): address, admin token, engine id
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class EngineConfig(BaseModel):
    """What one `RolloutEngine` may hold and how it runs. Budgets are in tokens, not bytes: one cached
    token costs ``2 * layers * kv_heads * head_dim * dtype_bytes`` bytes (`RolloutEngine.kv_bytes_per_token`)."""

    max_batch_size: int = Field(
        32,
        ge=1,
        description="most requests decoding together: one batched forward per step covers all of them; "
        "further requests wait in the queue until a row frees",
    )
    kv_budget_tokens: int = Field(
        262_144,
        ge=1,
        description="total cached tokens across all sessions (running and idle). Beyond it the caches of idle "
        "sessions are evicted least-recently-used first (counted in stats.evictions; their token histories "
        "stay, so their next call re-prefills and counts stats.recomputed_tokens). Running requests are never "
        "evicted: a new request is admitted only while the running requests' tokens plus its prompt fit, "
        "unless nothing else runs",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="longest sequence (prompt + output) of one request; None takes the model's "
        "max_position_embeddings. A longer prompt is refused; generation stops with finish_reason "
        "'length' when it is reached",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and KV dtype; 'auto' keeps the dtype the model was loaded with"
    )
    device: str = Field(
        "auto", description="'auto' = cuda when present, else cpu; or any torch device string"
    )
    seed: int = Field(
        0,
        description="seeds a request that brings no seed of its own: its generator is seeded from "
        "hash(seed, request_id), so its samples depend on neither batch composition nor arrival order",
    )
    prefill_chunk_tokens: int = Field(
        2048,
        ge=1,
        description="a prefill longer than this runs in chunks, bounding the activations at "
        "chunk x hidden (and, where a mask is used, the mask at chunk x context) instead of prompt x context",
    )
    flash_prefill: bool = Field(
        True,
        description="on the CPU, run a prefill chunk as two fused flash-attention calls (the held tokens, "
        "then the chunk itself) instead of one with a [chunk, context] mask: memory bounded by the KV",
    )
    engine_id: str = Field("rollout-0", description="stamped on every output (GenerateOutput.engine_id)")
    policy_version: int = Field(0, description="version of the weights the engine starts with")


class EngineServerConfig(BaseModel):
    """One engine server process (server.py): where it listens, who may administer it, and its engine."""

    model: str = Field(description="HF folder of the policy (config.json, safetensors, tokenizer)")
    host: str = Field("127.0.0.1", description="bind address; loopback unless told otherwise")
    port: int = Field(8100, ge=0, le=65535, description="bind port")
    served_model_name: str = Field("gyre-policy", description="the model id /v1/models lists")
    admin_token: str | None = Field(
        None,
        description="bearer token of the /admin API (weights, sleep, KV export/import); None = admin off",
    )
    engine_id: str | None = Field(
        None,
        description="this engine's id in the gateway's routing, stats and records; None = rollout-<port>, "
        "so engines on one host never share an id",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the engine itself")

    def engine_config(self) -> EngineConfig:
        """The engine's config with this server's engine id."""
        return self.engine.model_copy(update={"engine_id": self.engine_id or f"rollout-{self.port}"})
