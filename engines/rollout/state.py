"""The engine's bookkeeping: sessions (token history + KV) and requests in flight (its counters are
engines/admin.py's EngineCounters: /admin/stats carries them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.rollout.kv import KVRows
from engines.rollout.messages import FinishReason, GenerateOutput, GenerateRequest


@dataclass
class Session:
    """One conversation's context. The KV of ``tokens[:kv_len]`` is held: in ``kv`` (one row) while the
    session is idle or just prefilled, in a row of the engine's decode batch while its request decodes
    (then ``kv`` is None). After an eviction, sleep or drop, ``kv`` is None, ``kv_len`` 0 and ``tokens``
    stays as the history, so the next call knows which of its prefilled tokens are recomputed."""

    session_id: str
    tokens: list[int] = field(default_factory=list)
    kv: KVRows | None = None
    kv_len: int = 0
    last_used: int = 0
    request_id: str | None = None  # the request holding the session (one at a time; others queue)
    ephemeral: bool = False  # a request without session_id: dropped when the request ends

    def forget_kv(self) -> None:
        self.kv, self.kv_len = None, 0


@dataclass
class RequestState:
    """A request in flight. ``output_ids[-1]`` has been sampled but not fed yet: its KV is not in the
    session; the next decode step feeds it (``context`` is what the session's KV must cover)."""

    request: GenerateRequest
    generator: torch.Generator
    session_key: str
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    prefilled_tokens: int = 0
    started: bool = False  # its first prefill ran (cached_prompt_tokens is known)
    migrated: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def context(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids[:-1]

    def output(self, reason: FinishReason, engine_id: str) -> GenerateOutput:
        return GenerateOutput(
            request_id=self.request_id,
            session_id=self.request.session_id,
            output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs),
            finish_reason=reason,
            prompt_tokens=len(self.request.prompt_ids),
            cached_prompt_tokens=self.cached_prompt_tokens,
            prefilled_tokens=self.prefilled_tokens,
            policy_versions=list(self.policy_versions),
            engine_id=engine_id,
            migrated=self.migrated,
        )
