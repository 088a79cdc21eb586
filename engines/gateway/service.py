"""Gateway: one call end to end, independent of HTTP (app.py is the FastAPI front).

    gateway = Gateway(GatewayConfig(model="./models/tiny", engines=[EngineSpec(url=...)], ...))
    await gateway.start()
    completion = await gateway.chat(execution, agent_id="main", role="main", request=ChatCompletionRequest(...))

A chat call: (1) the agent's SessionContext turns the messages into prompt ids, reusing earlier ids
(context.py); (2) the Router sends them to the session's engine (router.py), with the end-of-turn and
end-of-text ids as stop_token_ids; (3) stop strings cut the output (a stop string that is one token goes
to the engine as a stop id; a longer one cuts the output after the token that completes it, so the
recorded ids stay a prefix of what the engine sampled); (4) the output is decoded and its tool calls
parsed (engines.model.chat.parse_tool_calls) into an assistant message with fresh tool_call ids;
(5) the call is recorded through trajectory_store's Recorder: prompt ids exactly as sent, output ids
exactly as generated (stop token included), raw logprobs, policy version, engine id, finish reason,
migrated flag, wall-clock start and end. A recording error is quarantined by the recorder, logged and
counted (stats.record_errors); the harness still gets its answer.

Hostile input (LimitsConfig): a prompt is measured in characters before anything is tokenized
(max_prompt_chars), then in tokens (max_prompt_tokens); a prompt above 32K characters is rendered and
tokenized on a tokenizer thread (GatewayConfig.tokenizer_threads) with the GIL released, so /health and
other executions keep being served meanwhile. An execution may make max_calls_per_execution calls, open
max_agents_per_execution agents and take in max_execution_tokens new ids; past any of them its calls get
400 execution_limit_exceeded. A finish's reward must be finite and in [0, 1] (422 otherwise).

Recording runs on ONE dedicated thread (a FIFO executor): the gateway numbers an execution's calls
itself (call_id, returned in the response's ``gyre`` field), hands each record to that thread as
soon as the handler has sent its answer (loop.call_soon) and never waits for it, so the recorder's validation, hashing and prefix-index work stay
off the request path; order is kept because the queue is FIFO. Everything else that touches a
recorder (record_execution, flush, forget) goes through the same queue, so a flush or a finished
execution always includes every call answered before it. Recorders: one per step (executions carry
their step); flushed when an execution finishes, on /admin/flush, and every flush_interval_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from engines.gateway.codec import ChatCodec
from engines.gateway.config import EngineSpec, GatewayConfig
from engines.gateway.context import SessionContext
from engines.gateway.engine_client import EngineClient
from engines.gateway.errors import EngineDown, EngineRejected, GatewayError
from engines.gateway.protocol import (
    AddEngine,
    ChatCompletionRequest,
    FinishExecution,
    RegisterExecution,
    SamplingFields,
    TextCompletionRequest,
    chat_completion,
    check_reward,
)
from engines.gateway.registry import Agent, Execution, Registry
from engines.gateway.router import EngineResult, Router
from engines.protocol import EngineCompletionRequest, GyreChoice, common_prefix
from trajectory_store.recorder import Recorder
from trajectory_store.schema import RecordError, Role
from trajectory_store.storage import Store

logger = logging.getLogger(__name__)
_INLINE_CHARS = 32_768  # prompts up to this size are tokenized on the event loop (well under a millisecond)


@dataclass
class GatewayStats:
    calls: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt ids taken from earlier calls (exactly as sent / generated)
    tokenized_prompt_tokens: int = 0  # prompt ids tokenized from text
    retokenized_assistant_messages: int = 0  # history the harness changed (or wrote), tokenized from text
    migrated_calls: int = 0
    stop_string_cuts: int = 0
    record_errors: int = 0
    client_errors: int = 0


@dataclass
class CallOutcome:
    """One engine call after stop strings: what is recorded and what the harness sees."""

    output_ids: list[int]
    output_logprobs: list[float]
    visible_text: str  # the decoded output, stop token / stop string excluded
    finish_reason: str  # 'stop' or 'length' (engine's, or 'stop' for a cut)
    engine_id: str
    policy_version: int
    call_id: int | None
    result: EngineResult


class Gateway:
    """Attributes: config, codec (ChatCodec), store, registry (executions), router (engines, sessions),
    recorders (step -> Recorder), stats (GatewayStats), overhead_ms (recent per-call gateway time
    excluding engine time, filled by app.py's timer)."""

    def __init__(self, config: GatewayConfig, codec: ChatCodec | None = None, store: Store | None = None):
        self.config = config
        self.codec = codec or ChatCodec.from_folder(config.model)
        self.store = store or Store(config.store)
        self.registry = Registry()
        self.router = Router()
        self.recorders: dict[int, Recorder] = {}
        self.stats = GatewayStats()
        self.overhead_ms: deque[float] = deque(maxlen=config.overhead_samples)
        self._flush_task: asyncio.Task | None = None
        self._recording = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-recorder")
        self._tokenizing = ThreadPoolExecutor(
            max_workers=config.tokenizer_threads, thread_name_prefix="gyre-tokenizer"
        )
        # response, request and tool-call ids: a random prefix per gateway + a counter (uuid4 would cost
        # a getrandom syscall per id on the hot path)
        self._id_prefix = secrets.token_hex(6)
        self._id_counter = itertools.count()

    # lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        for spec in self.config.engines:
            await self.add_engine(AddEngine(**spec.model_dump()))
        self._flush_task = asyncio.create_task(self._flush_periodically())

    async def close(self) -> None:
        if self._flush_task is not None:
            self._flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush_task
        await self.flush()
        self._recording.shutdown(wait=True)
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        for engine in self.router.engines.values():
            await engine.close()

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.flush_interval_s)
            try:
                await self.flush()
            except Exception:  # keep serving; the next flush retries what stayed buffered
                logger.exception("periodic flush of the recorders failed")

    def recorder(self, step: int) -> Recorder:
        recorder = self.recorders.get(step)
        if recorder is None:
            recorder = self.recorders[step] = Recorder(self.store, step)
        return recorder

    async def on_recorder(self, work: Callable[[], Any]) -> Any:
        """Runs ``work`` on the recording thread after every record queued before it."""
        return await asyncio.wrap_future(self._recording.submit(work))

    async def flush(self) -> dict[str, Any]:
        reports = await self.on_recorder(lambda: {s: r.flush() for s, r in list(self.recorders.items())})
        return {
            "calls": sum(r.calls for r in reports.values()),
            "executions": sum(r.executions for r in reports.values()),
            "quarantined": sum(r.quarantined for r in reports.values()),
            "manifests": [r.manifest for r in reports.values() if r.manifest],
        }

    # admin ------------------------------------------------------------------------------------------
    async def add_engine(self, body: AddEngine) -> dict[str, Any]:
        spec = EngineSpec(url=body.url, engine_id=body.engine_id, admin_token=body.admin_token)
        token = spec.admin_token or self.config.engine_admin_token
        engine = EngineClient(
            spec.engine_id or "pending",
            spec.url,
            admin_token=token,
            connect_timeout_s=self.config.engine_connect_timeout_s,
            timeout_s=self.config.engine_timeout_s,
        )
        try:
            await engine.probe()
            if spec.engine_id is None:
                engine.engine_id = await engine.own_engine_id() or f"engine-{len(self.router.engines)}"
        except (EngineDown, EngineRejected) as exc:
            await engine.close()
            raise GatewayError(
                502, f"cannot add the engine at {spec.url}: {exc}", code="engine_unreachable"
            ) from exc
        old = self.router.add(engine)
        if old is not None:
            await old.close()
        return {
            "engine_id": engine.engine_id,
            "url": engine.url,
            "model": engine.model_name,
            "replaced": old is not None,
        }

    def register_execution(self, body: RegisterExecution) -> dict[str, Any]:
        execution, created = self.registry.register(body, self.config.step)
        base = f"{self.config.base_url()}/x/{execution.execution_id}"
        return {
            "execution_id": execution.execution_id,
            "step": execution.step,
            "base_url": f"{base}/v1",
            "agent_base_url": f"{base}/agents/{{agent_id}}/v1",
            "api_key": execution.api_key,
            "created": created,
        }

    async def finish_execution(self, execution_id: str, body: FinishExecution) -> dict[str, Any]:
        check_reward(body.reward)  # before anything changes: a refused finish leaves the execution live
        execution = self.registry.finish(execution_id, body.status)
        recorder = self.recorder(execution.step)
        fields = dict(
            problem_id=execution.problem_id,
            group_id=execution.group_id,
            harness=execution.harness,
            reward=body.reward,
            reward_source=body.reward_source,
            snapshot_uri=body.snapshot_uri,
            started_at=execution.started_at,
            ended_at=time.time(),
        )
        try:
            await self.on_recorder(lambda: recorder.record_execution(execution_id, body.status, **fields))
        except RecordError as exc:
            raise GatewayError(
                400, f"the execution record was refused: {exc}", code="invalid_record"
            ) from exc
        busy = False
        for agent in execution.agents.values():
            busy |= agent.route.lock.locked()
            self.router.release(agent.route.session_id)
        flushed = await self.flush()
        if not busy:  # a call still in flight will record into the prefix index: keep it then
            await self.on_recorder(lambda: recorder.forget(execution_id))
        return {
            "execution_id": execution_id,
            "status": body.status,
            "calls": execution.calls,
            "flush": flushed,
        }

    def describe(self, *, samples: bool = False) -> dict[str, Any]:
        overhead = sorted(self.overhead_ms)
        timing: dict[str, Any] = {
            "samples": len(overhead),
            "p50": _quantile(overhead, 0.5),
            "p99": _quantile(overhead, 0.99),
        }
        if samples:
            timing["recent_ms"] = list(self.overhead_ms)
        return {
            **asdict(self.stats),
            "executions": len(self.registry.executions),
            "finished_executions": len(self.registry.finished),
            "gateway_overhead_ms": timing,
            **self.router.describe(),
        }

    # calls ------------------------------------------------------------------------------------------
    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter):x}"

    def agent(self, execution: Execution, agent_id: str) -> Agent:
        agent = execution.agents.get(agent_id)
        if agent is None:
            most = self.config.limits.max_agents_per_execution
            if len(execution.agents) >= most:
                raise GatewayError(
                    400,
                    f"execution {execution.execution_id} already has {len(execution.agents)} agents, the most "
                    f"one execution may open here (limits.max_agents_per_execution = {most}); "
                    f"agent {agent_id!r} was not opened",
                    param="agent_id",
                    code="execution_limit_exceeded",
                )
            route = self.router.route(f"{execution.execution_id}/{agent_id}")
            context = SessionContext(self.codec, self.config.fidelity_window_calls)
            agent = execution.agents[agent_id] = Agent(agent_id, context, route)
        return agent

    async def chat(
        self, execution: Execution, agent_id: str, role: Role, request: ChatCompletionRequest
    ) -> tuple[dict[str, Any], float]:
        """(the chat completion, seconds spent waiting on engines)."""
        _check_sampling(request)
        if request.top_logprobs:
            raise GatewayError(
                400,
                "top_logprobs is not supported (logprobs=true gives the chosen tokens')",
                param="top_logprobs",
            )
        chars = request.prompt_chars()
        self._check_prompt_chars(chars, "messages")
        self._check_execution(execution)
        agent = self.agent(execution, agent_id)
        messages = [m.template_dict() for m in request.messages]
        tools_on = request.tools_on()
        async with agent.route.lock:
            plan = await self._tokenize(chars, agent.context.plan, messages, request.tools)
            outcome = await self._call(execution, agent, role, plan.prompt_ids, request, plan.reused_tokens)
            content, calls = self.codec.parse_text(outcome.visible_text, tools_on=tools_on)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [
                    {
                        "id": f"call_{self.new_id()}",
                        "type": "function",
                        "function": {
                            "name": c["name"],
                            "arguments": json.dumps(c["arguments"], ensure_ascii=False),
                        },
                    }
                    for c in calls
                ]
            agent.context.commit(plan, outcome.output_ids, message)
        self.stats.reused_prompt_tokens += plan.reused_tokens
        self.stats.tokenized_prompt_tokens += plan.new_tokens
        self.stats.retokenized_assistant_messages += plan.retokenized_assistant
        finish = "tool_calls" if calls else outcome.finish_reason
        logprobs = None
        if request.logprobs:
            logprobs = {"content": self._logprob_entries(outcome)}
        gyre = self._gyre(execution, agent, role, outcome)
        gyre.update(reused_prompt_tokens=plan.reused_tokens, new_prompt_tokens=plan.new_tokens)
        completion = chat_completion(
            f"chatcmpl-{self.new_id()}",
            request.model or self.config.served_model_name,
            message,
            finish,
            self._usage(plan.prompt_ids, outcome),
            logprobs,
            gyre,
        )
        return completion, outcome.result.engine_seconds

    async def complete(
        self, execution: Execution, agent_id: str, role: Role, request: TextCompletionRequest
    ) -> tuple[dict[str, Any], float]:
        """Legacy completions: a text prompt is tokenized as is (no chat template); token ids are used as
        given (token in, token out: choices[0].token_ids)."""
        _check_sampling(request)
        if request.echo or (request.best_of or 1) > 1:
            raise GatewayError(400, "echo and best_of > 1 are not supported", param="echo")
        prompt = request.single_prompt()
        self._check_execution(execution)
        if isinstance(prompt, str):
            self._check_prompt_chars(len(prompt), "prompt")
            prompt_ids = await self._tokenize(len(prompt), self.codec.encode, prompt)
        else:
            self._check_prompt_tokens(len(prompt), "prompt")  # before scanning a huge list
            prompt_ids = list(prompt)
            vocab = self.codec.vocab_size
            if not all(isinstance(i, int) and 0 <= i < vocab for i in prompt_ids):
                raise GatewayError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
        agent = self.agent(execution, agent_id)
        async with agent.route.lock:
            known = common_prefix(agent.last_sequence, prompt_ids)
            outcome = await self._call(execution, agent, role, prompt_ids, request, known)
        logprobs = None
        if request.logprobs is not None:
            logprobs = {
                "tokens": self.codec.token_texts(outcome.output_ids),
                "token_logprobs": outcome.output_logprobs,
                "top_logprobs": None,
                "text_offset": None,
            }
        choice = {
            "index": 0,
            "text": outcome.visible_text,
            "logprobs": logprobs,
            "finish_reason": outcome.finish_reason,
            "token_ids": outcome.output_ids,
        }
        completion = {
            "id": f"cmpl-{self.new_id()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.model or self.config.served_model_name,
            "choices": [choice],
            "usage": self._usage(prompt_ids, outcome),
            "gyre": self._gyre(execution, agent, role, outcome),
        }
        return completion, outcome.result.engine_seconds

    async def _call(
        self,
        execution: Execution,
        agent: Agent,
        role: Role,
        prompt_ids: list[int],
        request: SamplingFields,
        known_tokens: int,
    ) -> CallOutcome:
        limits = self.config.limits
        self._check_prompt_tokens(len(prompt_ids), "messages")
        new_tokens = len(prompt_ids) - known_tokens
        if execution.taken_tokens + new_tokens > limits.max_execution_tokens:
            raise GatewayError(
                400,
                f"execution {execution.execution_id} has taken {execution.taken_tokens} tokens and this "
                f"call adds {new_tokens}, above the most one execution may take here "
                f"(limits.max_execution_tokens = {limits.max_execution_tokens}): finish it and start a new one",
                code="execution_limit_exceeded",
            )
        max_tokens = min(request.requested_max_tokens() or limits.default_max_tokens, limits.max_tokens_cap)
        stop_strings = request.stop_strings()
        stop_ids = dict.fromkeys(self.codec.stop_ids)
        token_stops = {}
        for text in stop_strings:
            ids = self.codec.encode(text)
            if len(ids) == 1 and self.codec.decode(ids) == text:
                token_stops[ids[0]] = text
                stop_ids[ids[0]] = None
        # built from checked values: model_construct spares a validation pass over a long prompt
        engine_request = EngineCompletionRequest.model_construct(
            prompt=prompt_ids,
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop_token_ids=list(stop_ids),
            logprobs=1,
            return_tokens_as_token_ids=True,
            return_token_ids=True,
            session_id=agent.route.session_id,
            request_id=f"gw-{self.new_id()}",
        )
        t_start = time.time()
        try:
            result = await self.router.generate(agent.route, engine_request, known_tokens)
        except EngineRejected as exc:
            status = 400 if exc.status in (400, 413, 422) else 502
            raise GatewayError(
                status, f"the engine refused the request: {exc.message}", code="engine_error"
            ) from exc
        t_end = time.time()
        choice = result.response.choice
        output_ids = list(choice.token_ids)
        logprobs = list(choice.logprobs.token_logprobs) if choice.logprobs else []
        gyre = choice.gyre or GyreChoice()
        output_ids, logprobs, versions, text, finish = self._cut(
            output_ids, logprobs, list(gyre.policy_versions), choice.finish_reason, token_stops, stop_strings
        )
        engine = result.engine
        version = min(versions) if versions else (engine.policy_version or 0)
        engine_id = gyre.engine_id or engine.engine_id
        migrated = result.migrated or gyre.migrated
        call_id = execution.calls
        record = dict(
            call_id=call_id,
            engine_id=engine_id,
            finish_reason=finish,
            migrated=migrated,
            t_start=t_start,
            t_end=t_end,
        )
        recorder = self.recorder(execution.step)
        record_args = (
            execution.execution_id,
            agent.agent_id,
            role,
            prompt_ids,
            output_ids,
            logprobs,
            version,
        )
        # queued once this handler yields (after its response is written): the recorder's CPU work then
        # never competes with building and sending the answer; FIFO order is unchanged
        asyncio.get_running_loop().call_soon(self._submit_record, recorder, record_args, record)
        execution.calls += 1
        execution.taken_tokens += new_tokens + len(output_ids)
        agent.calls += 1
        agent.last_sequence = prompt_ids + output_ids
        self.stats.calls += 1
        self.stats.prompt_tokens += len(prompt_ids)
        self.stats.output_tokens += len(output_ids)
        self.stats.migrated_calls += migrated
        return CallOutcome(output_ids, logprobs, text, finish, engine_id, version, call_id, result)

    # limits -----------------------------------------------------------------------------------------
    async def _tokenize(self, chars: int, work: Callable[..., Any], *args: Any) -> Any:
        """Runs ``work`` (a context plan, an encode) on a tokenizer thread when the prompt is large, so the
        event loop keeps serving; small prompts stay inline (a thread hop costs more than they do)."""
        if chars <= _INLINE_CHARS:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work, *args)

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        most = self.config.limits.max_prompt_chars
        if chars > most:
            raise GatewayError(
                400,
                f"the prompt holds {chars} characters, above this gateway's limit of {most} "
                "(limits.max_prompt_chars); it was refused before tokenization: compress the context "
                "(a summary call) or start a new one",
                param=param,
                code="context_length_exceeded",
            )

    def _check_prompt_tokens(self, tokens: int, param: str) -> None:
        most = self.config.limits.max_prompt_tokens
        if tokens > most:
            raise GatewayError(
                400,
                f"the prompt has {tokens} tokens, above this gateway's limit of {most} "
                "(limits.max_prompt_tokens): compress the context (a summary call) or start a new one",
                param=param,
                code="context_length_exceeded",
            )

    def _check_execution(self, execution: Execution) -> None:
        limits = self.config.limits
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

    def _submit_record(self, recorder: Recorder, args: tuple, fields: dict[str, Any]) -> None:
        self._recording.submit(recorder.record_call, *args, **fields).add_done_callback(self._recorded)

    def _recorded(self, future: Future) -> None:
        error = future.exception()
        if error is not None:  # the recorder quarantined the record with its reason
            self.stats.record_errors += 1
            logger.error("a call could not be recorded: %s", error)

    def _cut(
        self,
        ids: list[int],
        logprobs: list[float],
        versions: list[int],
        finish: str,
        token_stops: dict[int, str],
        stop_strings: list[str],
    ) -> tuple[list[int], list[float], list[int], str, str]:
        """Applies stop strings: (ids, logprobs, versions, visible text, finish reason). A stop string that
        is one token was also sent as a stop id: the engine ended on it, and the text before it is shown.
        Otherwise (or if a stop string shows up earlier, inside a merged token) the output is cut after the
        first token whose text completes a stop string."""
        if finish == "stop" and ids and ids[-1] in token_stops and ids[-1] not in self.codec.stop_ids:
            before = self.codec.decode(ids[:-1])
            if not any(s in before for s in stop_strings):
                return ids, logprobs, versions, before, "stop"
        text = self.codec.decode(ids)
        multi = list(stop_strings)
        if not any(s in text for s in multi):
            return ids, logprobs, versions, text, finish

        def has_stop(n: int) -> bool:
            prefix = self.codec.decode(ids[:n])
            return any(s in prefix for s in multi)

        low, high = 1, len(ids)  # the shortest prefix of ids whose text holds a stop string
        while low < high:
            middle = (low + high) // 2
            if has_stop(middle):
                high = middle
            else:
                low = middle + 1
        prefix = self.codec.decode(ids[:low])
        cut_at = min(prefix.find(s) for s in multi if s in prefix)
        self.stats.stop_string_cuts += 1
        return ids[:low], logprobs[:low], versions[:low], prefix[:cut_at], "stop"

    def _usage(self, prompt_ids: list[int], outcome: CallOutcome) -> dict[str, Any]:
        usage = outcome.result.response.usage
        details = usage.prompt_tokens_details if usage is not None else None
        cached = details.cached_tokens if details is not None else None
        return {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(outcome.output_ids),
            "total_tokens": len(prompt_ids) + len(outcome.output_ids),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _gyre(self, execution: Execution, agent: Agent, role: Role, outcome: CallOutcome) -> dict[str, Any]:
        return {
            "execution_id": execution.execution_id,
            "agent_id": agent.agent_id,
            "role": role,
            "call_id": outcome.call_id,
            "engine_id": outcome.engine_id,
            "policy_version": outcome.policy_version,
            "migrated": outcome.result.migrated,
            "rerouted": outcome.result.rerouted,
            "recomputed_tokens": outcome.result.recomputed_tokens,
        }

    def _logprob_entries(self, outcome: CallOutcome) -> list[dict[str, Any]]:
        ids = outcome.output_ids
        if ids and ids[-1] in self.codec.stop_ids:
            ids = ids[:-1]
        return [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(self.codec.token_texts(ids), outcome.output_logprobs, strict=False)
        ]


def _check_sampling(request: SamplingFields) -> None:
    if request.n != 1:
        raise GatewayError(400, "n > 1 is not supported: send n requests", param="n")


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return round(sorted_values[index], 4)
