"""What one request or execution may ask of the gateway (LimitsConfig), each checked before the work it
would cost, each breach a 400 that names the size, the limit and its config field.

    check_prompt_chars(limits, chars, "messages")    before rendering or tokenizing (max_prompt_chars)
    check_prompt_tokens(limits, tokens, "messages")  after tokenizing (max_prompt_tokens)
    check_execution(limits, execution)               when a call arrives (calls and tokens so far)
    check_new_agent(limits, execution, agent_id)     before an agent (a session) is opened
    check_new_tokens(limits, execution, new_tokens)  before a call is sent (tokens it would add)

Prompt limits answer code context_length_exceeded, as OpenAI does (a harness may compress and retry);
execution limits answer code execution_limit_exceeded (finishing the execution is the way out).
"""

from __future__ import annotations

from engines.gateway.config import LimitsConfig
from engines.gateway.errors import GatewayError
from engines.gateway.registry import Execution


def check_prompt_chars(limits: LimitsConfig, chars: int, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise GatewayError(
            400,
            f"the prompt holds {chars} characters, above this gateway's limit of {limits.max_prompt_chars} "
            "(limits.max_prompt_chars); it was refused before tokenization: compress the context "
            "(a summary call) or start a new one",
            param=param,
            code="context_length_exceeded",
        )


def check_prompt_tokens(limits: LimitsConfig, tokens: int, param: str) -> None:
    if tokens > limits.max_prompt_tokens:
        raise GatewayError(
            400,
            f"the prompt has {tokens} tokens, above this gateway's limit of {limits.max_prompt_tokens} "
            "(limits.max_prompt_tokens): compress the context (a summary call) or start a new one",
            param=param,
            code="context_length_exceeded",
        )


def check_execution(limits: LimitsConfig, execution: Execution) -> None:
    if execution.calls >= limits.max_calls_per_execution:
        raise GatewayError(
            400,
            f"execution {execution.execution_id} has made {execution.calls} calls, the most one execution "
            f"may make here (limits.max_calls_per_execution = {limits.max_calls_per_execution}): "
            "finish it and start a new one",
            code="execution_limit_exceeded",
        )
    if execution.taken_tokens >= limits.max_execution_tokens:
        raise GatewayError(
            400,
            f"execution {execution.execution_id} has taken {execution.taken_tokens} tokens, the most one "
            f"execution may take here (limits.max_execution_tokens = {limits.max_execution_tokens}): "
            "finish it and start a new one",
            code="execution_limit_exceeded",
        )


def check_new_agent(limits: LimitsConfig, execution: Execution, agent_id: str) -> None:
    if len(execution.agents) >= limits.max_agents_per_execution:
        raise GatewayError(
            400,
            f"execution {execution.execution_id} already has {len(execution.agents)} agents, the most one "
            f"execution may open here (limits.max_agents_per_execution = {limits.max_agents_per_execution}); "
            f"agent {agent_id!r} was not opened",
            param="agent_id",
            code="execution_limit_exceeded",
        )


def check_new_tokens(limits: LimitsConfig, execution: Execution, new_tokens: int) -> None:
    if execution.taken_tokens + new_tokens > limits.max_execution_tokens:
        raise GatewayError(
            400,
            f"execution {execution.execution_id} has taken {execution.taken_tokens} tokens and this call "
            f"adds {new_tokens}, above the most one execution may take here "
            f"(limits.max_execution_tokens = {limits.max_execution_tokens}): finish it and start a new one",
            code="execution_limit_exceeded",
        )
