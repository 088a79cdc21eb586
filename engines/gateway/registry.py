"""The execution registry: who may call the gateway, as which execution and agent.

    execution = registry.register(RegisterExecution(execution_id="e1", ...), default_step=0, ...)
    registry.authenticate("e1", token)      # 404 unknown / finished, 401 wrong key
    registry.by_key(token)                  # the key alone identifies the execution (/v1/... paths)
    registry.finish("e1")                   # the key stops working; the execution's agents are returned

Each execution gets a random API key (``gyre-`` + 32 url-safe random bytes); keys are compared in
constant time. An execution's agents are created on their first call: "main" (base_url
/x/<id>/v1) and sub-agents (/x/<id>/agents/<agent_id>/v1), each one engine session.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Literal

from engines.gateway.context import SessionContext
from engines.gateway.errors import GatewayError
from engines.gateway.protocol import RegisterExecution
from engines.gateway.router import SessionRoute
from trajectory_store.schema import Status


@dataclass(eq=False)
class Agent:
    agent_id: str
    context: SessionContext
    route: SessionRoute
    calls: int = 0
    last_sequence: list[int] = field(default_factory=list)  # prompt + output of its last call


@dataclass(eq=False)
class Execution:
    execution_id: str
    api_key: str
    step: int
    campaign: str | None = None  # None: the gateway's campaign
    problem_id: str | None = None
    group_id: str | None = None
    harness: str | None = None
    started_at: float = field(default_factory=time.time)
    agents: dict[str, Agent] = field(default_factory=dict)
    attempt: str | None = None  # the registering dispatcher's token (RegisterExecution.attempt)
    calls: int = 0
    call_base: int = 0  # the call_id of its first call here (RegisterExecution.first_call_id)
    taken_tokens: int = 0  # ids tokenized or generated for its calls (LimitsConfig.max_execution_tokens)


class Registry:
    """Live executions by id and by key, and the ids of finished ones (so their calls get a clear 404).

    A finished id is finished within its campaign: campaigns run one after another on one `gyre up`
    stack reuse the ids of their steps (s<step>-<problem>-g<member>), and a later campaign registers
    them afresh. A live id belongs to one campaign at a time (its calls are addressed by id)."""

    def __init__(self) -> None:
        self.executions: dict[str, Execution] = {}
        self._by_key: dict[str, Execution] = {}
        # (campaign, execution id) -> status, or "released" (its ending is recorded by another gateway)
        self.finished: dict[tuple[str | None, str], Status | Literal["released"]] = {}
        self._last_status: dict[str, str] = {}  # execution id -> status, for the 404's message

    def register(self, body: RegisterExecution, default_step: int) -> tuple[Execution, bool]:
        """(execution, created). Registering a live id again returns it unchanged (retry-safe)."""
        key = (body.campaign, body.execution_id)
        if self.finished.get(key) == "abandoned":
            raise GatewayError(
                409,
                f"execution {body.execution_id} was abandoned (its dispatcher died); register the next attempt",
                code="execution_superseded",
            )
        if key in self.finished:
            raise GatewayError(
                409,
                f"execution {body.execution_id} already finished; register a new id",
                code="execution_finished",
            )
        existing = self.executions.get(body.execution_id)
        if existing is not None and existing.campaign != body.campaign:
            raise GatewayError(
                409,
                f"execution id {body.execution_id} is live in campaign {existing.campaign!r}: campaigns "
                "running at once on one gateway need ids of their own",
                code="execution_id_taken",
            )
        if existing is not None:
            return existing, False
        if body.api_key is not None and body.api_key in self._by_key:
            raise GatewayError(
                409,
                f"the api_key given for {body.execution_id} is another live execution's",
                code="api_key_taken",
                param="api_key",
            )
        execution = Execution(
            execution_id=body.execution_id,
            api_key=body.api_key or "gyre-" + secrets.token_urlsafe(32),
            call_base=body.first_call_id,
            step=default_step if body.step is None else body.step,
            campaign=body.campaign,
            problem_id=body.problem_id,
            group_id=body.group_id,
            harness=body.harness,
            attempt=body.attempt,
        )
        self.executions[execution.execution_id] = execution
        self._by_key[execution.api_key] = execution
        return execution, True

    def get(self, execution_id: str) -> Execution:
        execution = self.executions.get(execution_id)
        if execution is not None:
            return execution
        if execution_id in self._last_status:
            message = f"execution {execution_id} has finished ({self._last_status[execution_id]}); it takes no more calls"
        else:
            message = f"unknown execution {execution_id!r}: register it with POST /admin/executions"
        raise GatewayError(404, message, code="execution_not_found")

    def authenticate(self, execution_id: str, token: str | None) -> Execution:
        execution = self.get(execution_id)
        if token is None or not secrets.compare_digest(token.encode(), execution.api_key.encode()):
            raise GatewayError(
                401, f"missing or wrong API key for execution {execution_id}", code="invalid_api_key"
            )
        return execution

    def by_key(self, token: str | None) -> Execution:
        execution = self._by_key.get(token or "")
        if execution is None:
            raise GatewayError(
                401,
                "missing or unknown API key: use the api_key POST /admin/executions returned",
                code="invalid_api_key",
            )
        return execution

    def target(self, execution: Execution) -> tuple[str | None, int]:
        return (execution.campaign, execution.step)

    def finish(self, execution_id: str, status: Status | Literal["released"]) -> Execution:
        execution = self.get(execution_id)
        del self.executions[execution_id]
        self._by_key.pop(execution.api_key, None)
        self.finished[(execution.campaign, execution_id)] = status
        self._last_status[execution_id] = status
        return execution
