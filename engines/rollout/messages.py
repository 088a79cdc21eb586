"""Typed messages across the engine boundary: token ids in, token ids + logprobs out (vLLM v1 style).

    SamplingParams   how to pick each next token of one request
    GenerateRequest  one model call: a session's full prompt as token ids, plus sampling
    GenerateOutput   the finished call: output ids, their logprobs, the policy versions that produced them

The prompt of a request is always the session's FULL context (what a harness sends over HTTP); the
engine finds by itself how much of it is already in the session's KV cache.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, computed_field, model_validator

FinishReason = Literal["stop", "length", "abort", "migrated"]


class SamplingParams(BaseModel):
    """Sampling of one request. Filters apply in vLLM's order: temperature, then top-k, then top-p over
    the top-k renormalised distribution."""

    temperature: float = Field(1.0, ge=0, description="0 = greedy (argmax); otherwise logits / temperature")
    top_p: float = Field(
        1.0, gt=0, le=1, description="keep the smallest head of the sorted distribution with mass >= top_p"
    )
    top_k: int = Field(0, ge=-1, description="keep the k most likely tokens; 0 or -1 = no limit")
    seed: int | None = Field(
        None,
        description="seeds this request's own torch.Generator (so batch composition never changes its samples); "
        "None derives one from EngineConfig.seed and the request id",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="generation stops after producing one of these; the stop token is part of output_ids "
        "(as vLLM's token_ids): it was sampled by the policy and is a training target",
    )
    max_tokens: int = Field(16, ge=1, description="most output tokens (finish_reason 'length' when reached)")


class GenerateRequest(BaseModel):
    """One model call of a session."""

    request_id: str
    session_id: str | None = Field(
        None,
        description="calls of one session share a KV cache: a prompt that extends (or shares a prefix with) "
        "the session's cached tokens prefills only the rest. None = a one-off session dropped at the end",
    )
    prompt_ids: list[int] = Field(min_length=1, description="the FULL prompt, token ids")
    sampling: SamplingParams = Field(default_factory=SamplingParams)


class GenerateOutput(BaseModel):
    """A finished (or aborted / migrated-away) request."""

    request_id: str
    session_id: str | None
    output_ids: list[int]
    output_logprobs: list[float] = Field(
        description="per output token: log_softmax of the RAW logits at that step, i.e. the policy's own "
        "logprob, before temperature / top-k / top-p (vLLM v1's default logprobs_mode='raw_logprobs'). "
        "This is the behaviour logprob the trainer's importance ratio needs at temperature 1; at other "
        "temperatures the sampling distribution differs from it by design"
    )
    finish_reason: FinishReason = Field(
        description="'stop' (a stop token was produced), 'length' (max_tokens or max_model_len), 'abort' "
        "(abort() was called), 'migrated' (export_session moved the request to another engine, which "
        "finishes it; this output holds the tokens produced here)"
    )
    prompt_tokens: int
    cached_prompt_tokens: int = Field(
        description="prompt tokens whose KV was reused from the session's cache"
    )
    prefilled_tokens: int = Field(
        description="tokens this request prefilled (its uncached prompt, plus any context recomputed after an "
        "eviction, sleep or weight swap with drop_kv)"
    )
    policy_versions: list[int] = Field(
        description="per output token, the policy version whose weights produced it (a request can straddle "
        "a weight swap; the KV of earlier tokens may come from older weights)"
    )
    engine_id: str
    migrated: bool = Field(False, description="the request's decode moved between engines at least once")

    @computed_field
    @property
    def policy_version(self) -> int | None:
        """The oldest version among the output tokens: the one a staleness bound must use."""
        return min(self.policy_versions) if self.policy_versions else None

    @model_validator(mode="after")
    def _aligned(self) -> GenerateOutput:
        if not len(self.output_ids) == len(self.output_logprobs) == len(self.policy_versions):
            raise ValueError("output_ids, output_logprobs and policy_versions must have one entry per token")
        return self
