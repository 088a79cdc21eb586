"""Typed configuration of the gateway (DESIGN.md section 3: each layer owns its config).

GatewayConfig   where it listens, who may administer it, which engines stand behind it, where calls
                are recorded; its sections: LimitsConfig, EngineSpec (one per engine), StoreConfig
"""

from __future__ import annotations

import hashlib
import os

from pydantic import BaseModel, ConfigDict, Field

from trajectory_store.storage import StoreConfig


class LimitsConfig(BaseModel):
    """What one request may ask for. Each breach is a 4xx with an OpenAI-style error body."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    max_request_bytes: int = Field(32 * 2**20, ge=1024)
    """largest request body; above it the gateway answers 413 without parsing it"""
    max_prompt_tokens: int = Field(262_144, ge=1)
    """longest prompt after the chat template; above it 400 (code context_length_exceeded). Each engine also
    refuses prompts that leave no room under its max_model_len (400 too)"""
    max_prompt_chars: int = Field(2 * 2**20, ge=1)
    """most characters a prompt may hold before it is tokenized (message contents, tool-call arguments, names,
    the tools' JSON; a text prompt of /v1/completions). Above it 400 (code context_length_exceeded) at once,
    without tokenizing: a 10 MB message costs a parse, not seconds of tokenization. The default is 8
    characters per token of max_prompt_tokens (BPE tokenizers average 3 to 5 on text and code), so a prompt
    that fits in tokens is not refused by it"""
    max_calls_per_execution: int = Field(
        10_000,
        ge=1,
        le=1 << 20,  # a standby gateway numbers an execution's calls from 2**20 (environments/gateways.py)
    )
    """most calls one execution may make (all its agents together); further calls get 400 (code
    execution_limit_exceeded)"""
    max_agents_per_execution: int = Field(256, ge=1)
    """most agents (sessions, each with its own context) one execution may open; a call that would open one
    more gets 400 (code execution_limit_exceeded)"""
    max_execution_tokens: int = Field(4 * 2**20, ge=1)
    """most token ids the gateway may take in for one execution: the prompt ids it tokenized plus the output
    ids it received, summed over the execution's calls (ids reused from earlier calls are not counted). It
    bounds what the gateway holds for an execution (its agents' contexts, the recorder's prefix index); a call
    that would pass it gets 400 (code execution_limit_exceeded)"""
    max_tokens_cap: int = Field(32_768, ge=1)
    """a request's max_tokens (or max_completion_tokens) is clamped to this"""
    default_max_tokens: int = Field(4096, ge=1)
    """max_tokens of a request that gives none (OpenAI's own default is unbounded)"""


class EngineSpec(BaseModel):
    """One rollout engine behind the gateway: our token-id server, or any vLLM-compatible one."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    url: str
    """base URL of the engine's HTTP server, e.g. http://127.0.0.1:8100"""
    engine_id: str | None = None
    """the engine's id in routing, stats, responses and records. Our engines name themselves (/v1/models, from
    their --engine-id): None takes that id, and a different one is refused; for an engine without an id of its
    own (vLLM) None means 'engine-<n>'"""
    admin_token: str | None = None
    """the engine's admin bearer token (KV export/import for drain); None =
    GatewayConfig.engine_admin_token"""
    host: str | None = None
    """the host the engine runs on (a [cluster] host name): engines on one host move a session's KV through
    shared memory, on two hosts over TCP. None: the host of its URL (every loopback address is one host)"""
    trainer_url: str | None = None
    """the cell's trainer replica (scheduler/remote.py ReplicaServer) beside the engine, for a cell on a host
    of [cluster] that the elastic scheduler switches to training; None: none"""


class GatewayConfig(BaseModel):
    """The gateway process: an OpenAI-compatible front for many rollout engines, recording every call."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    model: str
    """local folder of the policy's tokenizer (tokenizer.json, chat template)"""
    host: str = "127.0.0.1"
    """bind address; loopback unless told otherwise"""
    port: int = Field(8200, ge=0, le=65535)
    """bind port"""
    public_url: str | None = None
    """base of the per-execution base_urls handed out; None = http://<host>:<port>"""
    served_model_name: str = "gyre-policy"
    """the model id /v1/models lists"""
    admin_token: str | None = None
    """bearer token of the /admin API; None = admin endpoints answer 403"""
    engines: list[EngineSpec] = Field(default_factory=list)
    """engines added at startup"""
    engine_admin_token: str | None = None
    """default admin token of the engines (their KV export/import endpoints)"""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    """where calls and executions land"""
    step: int = Field(0, ge=0)
    """step of an execution registered without one"""
    flush_interval_s: float = Field(30.0, gt=0)
    """the recorders flush this often (and on every finished execution and /admin/flush)"""
    spool_dir: str | None = None
    """local folder where every unflushed row is also kept, so a gateway killed between flushes loses no call:
    the next one started with the same folder writes them (default: <data_root>/spool/gateway-<port> for a
    local data root, ~/.cache/gyre/spool/<data root hash>-<port> for S3; an empty string turns it off)"""
    engine_connect_timeout_s: float = Field(5.0, gt=0)
    """connecting to an engine"""
    engine_timeout_s: float | None = Field(None, gt=0)
    """most seconds one engine call may take; None = as long as the generation takes (an agent's call can
    legitimately decode for minutes)"""
    engine_watch_interval_s: float | None = Field(5.0, gt=0)
    """seconds between health checks (GET /health) of each engine with calls in flight; None turns them off.
    An engine that misses engine_watch_misses in a row is dead: its calls re-run on another engine. Without
    them, a call to an engine that stops answering without closing its connections (its host cut off from the
    network, a frozen process) waits for ever"""
    engine_watch_misses: int = Field(3, ge=1)
    """missed health checks in a row that make an engine dead"""
    engine_watch_timeout_s: float = Field(5.0, gt=0)
    """how long one health check waits for its answer"""
    tokenizer_threads: int = Field(2, ge=1)
    """threads that render and tokenize large prompts (above 32K characters) off the event loop, so /health
    and other executions' calls keep being served; at most this many large prompts are tokenized at once (the
    others wait), which also bounds the memory tokenization takes"""
    fidelity_window_calls: int = Field(32, ge=1)
    """per (execution, agent), the last this-many calls' token ids are kept for reuse; an older context sent
    again is re-tokenized (and counted)"""
    access_log: bool = False
    """log one line per HTTP request (client, method and path, status, milliseconds, engine milliseconds of a
    completion; never a key or a body) on the engines.gateway.access logger, which python -m engines.gateway
    prints on stderr"""
    overhead_samples: int = Field(10_000, ge=100)
    """how many recent per-call overhead timings /admin/stats summarizes"""

    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")

    def spool_folder(self) -> str | None:
        """Where the recorders spool (spool_dir, or its default); None when turned off."""
        if self.spool_dir is not None:
            return self.spool_dir or None
        root = self.store.data_root
        if "://" not in root:
            return os.path.join(root, "spool", f"gateway-{self.port}")
        digest = hashlib.sha256(root.encode()).hexdigest()[:16]
        return os.path.join(os.path.expanduser("~/.cache/gyre/spool"), f"{digest}-{self.port}")
