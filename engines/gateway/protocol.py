"""The OpenAI wire format the gateway speaks: request models (lenient: unknown fields are ignored, as
vLLM does) and the response / stream-chunk builders.

    ChatCompletionRequest   POST .../v1/chat/completions
    TextCompletionRequest   POST .../v1/completions (prompt: text or token ids, one prompt per request)
    RegisterExecution, FinishExecution   the execution admin bodies; check_reward (finite, in REWARD_RANGE)
                            (the engine-management admin bodies are engines/admin.py's)
    chat_completion, text_completion (+ assistant_message, usage, call_info, chat_logprobs,
    text_logprobs)          the answers; chat_chunks, completion_chunks, sse: the same as a stream

Supported: messages (system, developer = system, user, assistant with tool_calls, tool), tools,
tool_choice ("none" turns tool-call parsing off; "auto", "required" and a named function parse tool
calls but cannot force one: no guided decoding), temperature, top_p, top_k (extension), seed,
max_tokens / max_completion_tokens, stop (strings), stream (+ stream_options.include_usage), logprobs
(chosen tokens only; top_logprobs lists are empty). Refused with 400: n > 1, echo, best_of > 1.
Ignored: response_format, frequency/presence penalties, logit_bias, parallel_tool_calls, user.
Gyre extensions (header or extra_body): X-Gyre-Role / gyre_role, X-Gyre-Agent / gyre_agent.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any, Literal, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engines.gateway.errors import GatewayError
from engines.protocol import ID_PATTERN
from trajectory_store.schema import ROLES, RewardSource, Role, Status

# who wrote a chat message (OpenAI's word); not the agent Role of a call (trajectory_store.schema)
MessageRole = Literal["system", "developer", "user", "assistant", "tool"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: MessageRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it (developer becomes system)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        message["content"] = self.content
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    gyre_role: Role | None = None
    gyre_agent: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or []):
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        return tools

    def tools_on(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def prompt_chars(self) -> int:
        """Characters the chat template will render from this request, give or take its own markup:
        message contents, names, tool-call arguments, and the tools' JSON. Cheap (no rendering), so a
        huge request is refused before anything is tokenized."""
        total = len(orjson.dumps(self.tools)) if self.tools else 0
        for message in self.messages:
            content = message.content
            if isinstance(content, str):
                total += len(content)
            elif content:
                total += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
            total += len(message.name or "") + len(message.tool_call_id or "")
            for call in message.tool_calls or ():
                arguments = call.function.arguments
                total += len(call.function.name) + (
                    len(arguments) if isinstance(arguments, str) else len(orjson.dumps(arguments))
                )
        return total


class TextCompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise GatewayError(400, "one prompt per request (send several requests)", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise GatewayError(400, "prompt is empty", param="prompt")
        return prompt


class RegisterExecution(_Lenient):
    execution_id: str = Field(pattern=ID_PATTERN)
    problem_id: str | None = None
    group_id: str | None = None
    step: int | None = Field(None, ge=0)
    harness: str | None = None
    campaign: str | None = Field(
        None,
        pattern=ID_PATTERN,
        description="record the execution in this campaign of the gateway's data root (default: the "
        "gateway's own; a held-out evaluation beside a training campaign uses one)",
    )
    attempt: str | None = Field(
        None,
        max_length=128,
        description="an opaque token of the dispatcher's attempt: registering a live execution again "
        "with the same token returns it (a retried request); with another token, the live one belonged "
        "to a dispatcher that died: it is recorded as abandoned and the register is refused with 409 "
        "execution_superseded, so the new attempt takes a new id and never inherits the old one's calls",
    )
    api_key: str | None = Field(
        None,
        min_length=32,
        max_length=128,
        pattern=r"^[A-Za-z0-9_\-]+$",
        description="the key the execution's calls carry (default: a new random one); a dispatcher with "
        "several gateways registers an execution at its standby gateway under the key its primary gave, "
        "so the harness's calls are accepted by either",
    )
    first_call_id: int = Field(
        0,
        ge=0,
        description="the call_id of the execution's first call here; a standby gateway numbers its calls "
        "from a base of its own, so calls recorded by two gateways never share an id",
    )


class FinishExecution(_Lenient):
    status: Status
    reward: float | None = Field(
        None, description="in REWARD_RANGE and finite (check_reward); None when there is none (eval_failed)"
    )
    reward_source: RewardSource | None = None
    snapshot_uri: str | None = None
    calls_elsewhere: int = Field(
        0, ge=0, description="calls of this execution that other gateways answered (its n_calls counts them)"
    )


def call_role(value: str | None, agent_id: str) -> Role:
    """The Role of a call: ``value`` (X-Gyre-Role or gyre_role) checked, else "main" for the main agent
    and "sub" for the others."""
    if value is None:
        return "main" if agent_id == "main" else "sub"
    if value not in ROLES:
        raise GatewayError(
            400, f"unknown role {value!r}; expected one of {', '.join(ROLES)}", param="gyre_role"
        )
    return cast(Role, value)  # checked against ROLES, the Literal's values


REWARD_RANGE = (0.0, 1.0)  # the graders give passed / total


def check_reward(reward: float | None) -> None:
    """422 unless ``reward`` is None or a finite number in REWARD_RANGE."""
    low, high = REWARD_RANGE
    if reward is not None and not (math.isfinite(reward) and low <= reward <= high):
        raise GatewayError(
            422,
            f"reward {reward!r} is not a finite number in [{low:g}, {high:g}]: a reward is the share of "
            "the problem's checks that passed (passed / total)",
            param="reward",
            code="invalid_reward",
        )


# responses --------------------------------------------------------------------------------------------
def assistant_message(
    content: str | None, tool_calls: list[dict[str, Any]], new_id: Callable[[], str]
) -> dict[str, Any]:
    """The assistant message of a chat completion; parsed tool calls ({"name", "arguments": dict}) get
    fresh ids (call_<new_id()>) and their arguments as a JSON string, as OpenAI sends them."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{new_id()}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for c in tool_calls
        ]
    return message


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def call_info(
    *,
    execution_id: str,
    agent_id: str,
    role: Role,
    call_id: int | None,
    engine_id: str,
    policy_version: int,
    migrated: bool,
    rerouted: bool,
    recomputed_tokens: int,
) -> dict[str, Any]:
    """The response's ``gyre`` field: where the call is recorded and how it was served."""
    return {
        "execution_id": execution_id,
        "agent_id": agent_id,
        "role": role,
        "call_id": call_id,
        "engine_id": engine_id,
        "policy_version": policy_version,
        "migrated": migrated,
        "rerouted": rerouted,
        "recomputed_tokens": recomputed_tokens,
    }


def chat_logprobs(token_texts: list[str], logprobs: list[float]) -> dict[str, Any]:
    """OpenAI chat logprobs of the chosen tokens (top_logprobs lists are empty)."""
    return {
        "content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(token_texts, logprobs, strict=False)
        ]
    }


def text_logprobs(token_texts: list[str], logprobs: list[float]) -> dict[str, Any]:
    """OpenAI completions logprobs of the chosen tokens."""
    return {"tokens": token_texts, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}


def chat_completion(
    response_id: str,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    usage: dict[str, Any],
    logprobs: dict[str, Any] | None,
    gyre: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage,
        "system_fingerprint": None,
        "gyre": gyre,
    }


def text_completion(
    response_id: str,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str,
    usage: dict[str, Any],
    logprobs: dict[str, Any] | None,
    gyre: dict[str, Any],
) -> dict[str, Any]:
    """A /v1/completions answer; choices[0].token_ids holds the output ids (token in, token out)."""
    choice = {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "token_ids": token_ids,
    }
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
        "gyre": gyre,
    }


def chat_chunks(completion: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A finished chat completion as the stream of chunks OpenAI would send (role, content, tool calls,
    finish reason, then usage when asked for)."""
    choice = completion["choices"][0]
    message = choice["message"]
    head = {k: completion[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk"

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {
            **head,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}, logprobs=choice.get("logprobs")))
    for index, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}))
    last = chunk({}, choice["finish_reason"])
    last["gyre"] = completion["gyre"]
    chunks.append(last)
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    return chunks


def completion_chunks(completion: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    choice = completion["choices"][0]
    head = {k: completion[k] for k in ("id", "created", "model")}
    head["object"] = "text_completion"
    body = {"index": 0, "text": choice["text"], "logprobs": choice["logprobs"], "finish_reason": None}
    chunks = [{**head, "choices": [body]}]
    chunks.append(
        {
            **head,
            "choices": [{**body, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}],
        }
    )
    chunks[-1]["gyre"] = completion["gyre"]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": completion["usage"]})
    return chunks


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
