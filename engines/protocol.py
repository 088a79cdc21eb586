"""The wire between the gateway and the rollout engines: typed messages both sides import, as vLLM v1's
EngineCoreRequest / EngineCoreOutput are shared by its client and its engine core.

    EngineCompletionRequest  POST /v1/completions: a session's full prompt as token ids + sampling
    EngineCompletion         its answer: EngineChoice (token_ids, ChoiceLogprobs, finish_reason, and our
                             per-choice extension GyreChoice) + EngineUsage
    ModelCard, ModelList     GET /v1/models (max_model_len and engine_id are our extensions)
    common_prefix            how much of a new prompt the receiver already holds (both sides use it)
    WireModel, ID_PATTERN    the base of every wire model (here and in engines/admin.py, the admin wire),
                             and the ids the gateway accepts for executions, agents and engines

The fields are vLLM's, named and typed as in vLLM's completions protocol (see engines/rollout/server.py for
what was checked): a vLLM server can stand behind the gateway, so every model here is lenient (unknown
fields are ignored) and everything that is ours is optional on the way in (``gyre``, ``engine_id``,
``prompt_tokens_details``). finish_reason is a plain string on the wire: our engine answers 'stop',
'length', 'abort' or 'migrated' (engines/rollout/messages.py FinishReason), a vLLM engine may add its own.

No torch here and nothing of the rollout engine: the gateway imports this module without loading a model.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$"


class WireModel(BaseModel):
    """Lenient (unknown fields are ignored), so either side may be newer than the other."""

    # -inf logprobs travel as JSON's -Infinity (as Python's json writes them), not as null
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="constants")


# requests ---------------------------------------------------------------------------------------------
class EngineCompletionRequest(WireModel):
    """The vLLM completions fields an engine serves, on token ids (there is no tokenizer in an engine)."""

    model: str | None = None
    prompt: list[int] | list[list[int]] = Field(description="token ids, or a list of token id lists")
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = no limit")
    seed: int | None = None
    stop_token_ids: list[int] | None = Field(
        None, description="generation stops after one of these (it is part of token_ids)"
    )
    logprobs: int | None = Field(None, ge=0, description="1 = the chosen tokens' raw logprobs")
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    n: int = 1
    stream: bool | None = False
    echo: bool | None = False
    session_id: str | None = Field(None, description="extension: calls of one session share a KV cache")
    request_id: str | None = None


# responses --------------------------------------------------------------------------------------------
class GyreChoice(WireModel):
    """Our extension of a choice: where and how its tokens were made."""

    request_id: str | None = None
    session_id: str | None = None
    policy_versions: list[int] = Field(
        default_factory=list, description="per output token, the weights version that produced it"
    )
    engine_id: str | None = None
    cached_prompt_tokens: int = 0
    prefilled_tokens: int | None = Field(
        None, description="prompt (and recomputed context) tokens this request ran a prefill over"
    )
    migrated: bool = False


class ChoiceLogprobs(WireModel):
    """vLLM's completions logprobs; ours are raw (log-softmax of the logits before temperature, top-k,
    top-p) and our top_logprobs entries are None: read token_logprobs."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    tokens: list[str] = Field(
        default_factory=list, description="'token_id:N' with return_tokens_as_token_ids"
    )
    top_logprobs: list[dict[str, float] | None] | None = None


class EngineChoice(WireModel):
    index: int = 0
    text: str = ""
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = Field(description="'stop', 'length', 'abort', 'migrated' (ours)")
    stop_reason: int | str | None = None
    token_ids: list[int] = Field(description="the output ids (return_token_ids), stop token included")
    gyre: GyreChoice | None = None


class PromptTokensDetails(WireModel):
    cached_tokens: int | None = None


class EngineUsage(WireModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class EngineCompletion(WireModel):
    id: str
    object: str = "text_completion"
    created: int = 0
    model: str | None = None
    choices: list[EngineChoice] = Field(min_length=1)
    usage: EngineUsage | None = None

    @property
    def choice(self) -> EngineChoice:
        """The only choice of a single-prompt request (what the gateway always sends)."""
        return self.choices[0]

    def prefilled_tokens(self) -> int:
        """Tokens the engine ran a prefill over for this request: its own count when it gives one, else
        (a vLLM engine) the prompt minus the prefix-cache hits."""
        gyre = self.choice.gyre
        if gyre is not None and gyre.prefilled_tokens is not None:
            return gyre.prefilled_tokens
        usage = self.usage or EngineUsage()
        cached = (usage.prompt_tokens_details or PromptTokensDetails()).cached_tokens or 0
        return usage.prompt_tokens - cached


class ModelCard(WireModel):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "gyrerl"
    max_model_len: int | None = Field(None, description="longest prompt + output one request may have")
    engine_id: str | None = Field(
        None,
        description="extension: the engine's own id, which the gateway uses in routing, stats and records",
    )


class ModelList(WireModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# token ids --------------------------------------------------------------------------------------------
def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token id lists: how much of a new prompt the receiver
    already holds (the engine's session cache, the gateway's last sequence of an agent)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a prompt extending what is held) at C speed
        return n
    i = 0
    while a[i] == b[i]:  # a mismatch lies before n
        i += 1
    return i
