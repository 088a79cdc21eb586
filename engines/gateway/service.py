"""Gateway: one call end to end, independent of HTTP (app.py is the FastAPI front).

    gateway = Gateway(GatewayConfig(model="./models/tiny", engines=[EngineSpec(url=...)], ...))
    await gateway.start()
    completion = await gateway.chat(execution, agent_id="main", role="main", request=ChatCompletionRequest(...))

A chat call: (1) limits.py checks the request's size and the execution's caps; (2) the agent's
SessionContext turns the messages into prompt ids, reusing earlier ids (context.py), on a tokenizer
thread when the prompt is large; (3) the Router sends them to the session's engine as an
EngineCompletionRequest (router.py, engines/protocol.py), with the end-of-turn and end-of-text ids as
stop_token_ids; (4) stop strings cut the output (stops.py); (5) the output is decoded and its tool calls
parsed (the model's format: engines/model/tool_calls.py) into an assistant message; (6) the call is recorded
(recording.py): prompt ids exactly as sent, output ids exactly as generated (stop token included), raw
logprobs, policy version, engine id, finish reason, migrated flag, wall-clock start and end; (7) the
answer is built by protocol.py.

Hostile input (LimitsConfig, limits.py): a prompt is measured in characters before anything is tokenized
(max_prompt_chars), then in tokens (max_prompt_tokens); a prompt above 32K characters is rendered and
tokenized on a tokenizer thread (GatewayConfig.tokenizer_threads) with the GIL released, so /health and
other executions keep being served meanwhile. An execution may make max_calls_per_execution calls, open
max_agents_per_execution agents and take in max_execution_tokens new ids; past any of them its calls get
400 execution_limit_exceeded. A finish's reward must be finite and in [0, 1] (422 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engines.admin import (
    AddEngine,
    EngineAdded,
    FlushReport,
    GatewayCounters,
    GatewayStatsReport,
    OverheadSummary,
    StoreAddress,
)
from engines.gateway import limits
from engines.gateway.codec import ChatCodec
from engines.gateway.config import EngineSpec, GatewayConfig
from engines.gateway.context import SessionContext
from engines.gateway.errors import EngineRejected, GatewayError
from engines.gateway.protocol import (
    ChatCompletionRequest,
    FinishExecution,
    RegisterExecution,
    SamplingFields,
    TextCompletionRequest,
    assistant_message,
    call_info,
    chat_completion,
    chat_logprobs,
    check_reward,
    text_completion,
    text_logprobs,
    usage,
)
from engines.gateway.recording import CallRecording
from engines.gateway.registry import Agent, Execution, Registry
from engines.gateway.router import EngineResult, Router
from engines.gateway.stops import StopStrings
from engines.protocol import EngineCompletionRequest, GyreChoice, common_prefix
from engines.quantiles import quantile
from trajectory_store.schema import RecordError, Role
from trajectory_store.storage import Store

logger = logging.getLogger(__name__)

_INLINE_CHARS = 32_768  # prompts up to this size are tokenized on the event loop (well under a millisecond)


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
    recording (CallRecording: the recorders), stats (GatewayCounters), overhead_ms (recent per-call gateway
    time excluding engine time, filled by app.py's timer)."""

    def __init__(self, config: GatewayConfig, codec: ChatCodec | None = None, store: Store | None = None):
        self.config = config
        self.codec = codec or ChatCodec.from_folder(config.model)
        self.store = store or Store(config.store)
        self.registry = Registry()
        self.router = Router()
        self.recording = CallRecording(self.store, config.flush_interval_s, config.spool_folder())
        self.stats = GatewayCounters()
        self.overhead_ms: deque[float] = deque(maxlen=config.overhead_samples)
        self._tokenizing = ThreadPoolExecutor(
            max_workers=config.tokenizer_threads, thread_name_prefix="gyre-tokenizer"
        )
        # response, request and tool-call ids: a random prefix per gateway + a counter (uuid4 would cost
        # a getrandom syscall per id on the hot path)
        self._id_prefix = secrets.token_hex(6)
        self._id_counter = itertools.count()
        self._watch: asyncio.Task | None = None  # Router.watch: engines that stop answering

    # lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        for spec in self.config.engines:
            await self.add_engine(AddEngine(**spec.model_dump()))
        await self.recording.start()
        config = self.config
        if config.engine_watch_interval_s is not None:
            self._watch = asyncio.create_task(
                self.router.watch(
                    config.engine_watch_interval_s, config.engine_watch_misses, config.engine_watch_timeout_s
                )
            )

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.recording.close()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        for engine in self.router.engines.values():
            await engine.close()

    async def flush(self) -> FlushReport:
        return FlushReport(**await self.recording.flush())

    def banner(self) -> str:
        """One line saying where the gateway serves, what stands behind it and where calls land."""
        config = self.config
        engines = ", ".join(f"{e.engine_id} {e.url}" for e in self.router.engines.values()) or "none yet"
        public = f" (base_urls under {config.public_url})" if config.public_url else ""
        return (
            f"gyre gateway on http://{config.host}:{config.port}{public}: engines {engines}; "
            f"data root {config.store.data_root}, campaign {config.store.campaign}, step {config.step}; "
            f"admin API {'on' if config.admin_token else 'off'}, access log {'on' if config.access_log else 'off'}"
        )

    # admin ------------------------------------------------------------------------------------------
    async def add_engine(self, body: AddEngine) -> EngineAdded:
        spec = EngineSpec(
            url=body.url,
            engine_id=body.engine_id,
            admin_token=body.admin_token,
            host=body.host,
            trainer_url=body.trainer_url,
        )
        engine, old = await self.router.connect(
            spec,
            admin_token=self.config.engine_admin_token,
            connect_timeout_s=self.config.engine_connect_timeout_s,
            timeout_s=self.config.engine_timeout_s,
        )
        return EngineAdded(
            engine_id=engine.engine_id, url=engine.url, model=engine.model_name, replaced=old is not None
        )

    async def register_execution(self, body: RegisterExecution) -> dict[str, Any]:
        live = self.registry.executions.get(body.execution_id)
        if (
            live is not None
            and live.campaign == body.campaign
            and body.attempt is not None
            and live.attempt != body.attempt
        ):
            # Another dispatcher's attempt, never finished: its calls are recorded under an abandoned
            # execution, so no reward of the new attempt is ever joined to them.
            await self.finish_execution(body.execution_id, FinishExecution(status="abandoned"))
            raise GatewayError(
                409,
                f"execution {body.execution_id} was live under another attempt; it is now recorded as "
                "abandoned: register the next attempt under a new id",
                code="execution_superseded",
            )
        execution, created = self.registry.register(body, self.config.step)
        base = f"{self.config.base_url()}/x/{execution.execution_id}"
        return {
            "execution_id": execution.execution_id,
            "step": execution.step,
            "campaign": execution.campaign or self.config.store.campaign,
            "base_url": f"{base}/v1",
            "agent_base_url": f"{base}/agents/{{agent_id}}/v1",
            "api_key": execution.api_key,
            "created": created,
        }

    async def finish_execution(self, execution_id: str, body: FinishExecution) -> dict[str, Any]:
        check_reward(body.reward)  # before anything changes: a refused finish leaves the execution live
        execution = self.registry.finish(execution_id, body.status)
        try:
            await self.recording.record_execution(
                self.registry.target(execution),
                execution_id,
                body.status,
                problem_id=execution.problem_id,
                group_id=execution.group_id,
                harness=execution.harness,
                started_at=execution.started_at,
                ended_at=time.time(),
                **body.model_dump(exclude={"status"}),  # reward, reward_source, snapshot_uri, calls_elsewhere
            )
        except RecordError as exc:
            raise GatewayError(
                400, f"the execution record was refused: {exc}", code="invalid_record"
            ) from exc
        return {
            "execution_id": execution_id,
            "status": body.status,
            "calls": execution.calls,
            "flush": await self._let_go(execution),
        }

    async def release_execution(self, execution_id: str) -> dict[str, Any]:
        """The execution leaves this gateway without a row of its own (another gateway records its
        ending): its sessions are released and the calls it made here flushed."""
        execution = self.registry.finish(execution_id, "released")
        return {
            "execution_id": execution_id,
            "calls": execution.calls,
            "flush": await self._let_go(execution),
        }

    async def _let_go(self, execution: Execution) -> dict[str, Any]:
        """Releases a finished execution's engine sessions, flushes, drops its prefix index; the flush
        report (or why it failed: the rows then stay buffered and the periodic flush retries)."""
        busy = False
        for agent in execution.agents.values():
            busy |= agent.route.lock.locked()
            self.router.release(agent.route.session_id)
        try:
            flushed = (await self.flush()).model_dump()
        except Exception as exc:  # the store is down: the rows stay buffered, the periodic flush retries
            logger.warning(
                "flushing at the end of %s failed (the rows stay buffered): %s", execution.execution_id, exc
            )
            flushed = {"error": f"{type(exc).__name__}: {exc}"[:500], "buffered": True}
        if not busy:  # a call still in flight will record into the prefix index: keep it then
            await self.recording.forget(self.registry.target(execution), execution.execution_id)
        return flushed

    def describe(self, *, samples: bool = False) -> GatewayStatsReport:
        """GET /admin/stats (``samples``: with every recent overhead sample)."""
        overhead = sorted(self.overhead_ms)
        timing = OverheadSummary(
            samples=len(overhead),
            p50=quantile(overhead, 0.5, digits=4),
            p99=quantile(overhead, 0.99, digits=4),
            recent_ms=list(self.overhead_ms) if samples else None,
        )
        store = self.config.store
        return GatewayStatsReport(
            **self.stats.model_dump(),
            **self.router.stats.model_dump(),
            record_errors=self.recording.errors,
            executions=len(self.registry.executions),
            finished_executions=len(self.registry.finished),
            store=StoreAddress(data_root=store.data_root, campaign=store.campaign),
            step=self.config.step,
            gateway_overhead_ms=timing,
            engines=self.router.views(),
            sessions=len(self.router.sessions),
        )

    # calls ------------------------------------------------------------------------------------------
    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter):x}"

    def agent(self, execution: Execution, agent_id: str) -> Agent:
        agent = execution.agents.get(agent_id)
        if agent is None:
            limits.check_new_agent(self.config.limits, execution, agent_id)
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
        limits.check_prompt_chars(self.config.limits, chars, "messages")
        limits.check_execution(self.config.limits, execution)
        agent = self.agent(execution, agent_id)
        messages = [m.template_dict() for m in request.messages]
        tools_on = request.tools_on()
        async with agent.route.lock:
            plan = await self._tokenize(chars, agent.context.plan, messages, request.tools)
            outcome = await self._call(execution, agent, role, plan.prompt_ids, request, plan.reused_tokens)
            content, calls = self.codec.parse_text(outcome.visible_text, tools_on=tools_on)
            message = assistant_message(content, calls, self.new_id)
            # a Jinja template renders the whole conversation again here: as costly as the plan
            work = 0 if self.codec.renderer.incremental else chars
            await self._tokenize(work, agent.context.commit, plan, outcome.output_ids, message)
        self.stats.reused_prompt_tokens += plan.reused_tokens
        self.stats.tokenized_prompt_tokens += plan.new_tokens
        self.stats.retokenized_assistant_messages += plan.retokenized_assistant
        logprobs = None
        if request.logprobs:
            ids = outcome.output_ids
            if ids and ids[-1] in self.codec.stop_ids:
                ids = ids[:-1]
            logprobs = chat_logprobs(self.codec.token_texts(ids), outcome.output_logprobs)
        gyre = self._call_info(execution, agent, role, outcome)
        gyre.update(reused_prompt_tokens=plan.reused_tokens, new_prompt_tokens=plan.new_tokens)
        completion = chat_completion(
            f"chatcmpl-{self.new_id()}",
            request.model or self.config.served_model_name,
            message,
            "tool_calls" if calls else outcome.finish_reason,
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
        limits.check_execution(self.config.limits, execution)
        if isinstance(prompt, str):
            limits.check_prompt_chars(self.config.limits, len(prompt), "prompt")
            prompt_ids = await self._tokenize(len(prompt), self.codec.encode, prompt)
        else:
            limits.check_prompt_tokens(self.config.limits, len(prompt), "prompt")  # before scanning it
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
            logprobs = text_logprobs(self.codec.token_texts(outcome.output_ids), outcome.output_logprobs)
        completion = text_completion(
            f"cmpl-{self.new_id()}",
            request.model or self.config.served_model_name,
            outcome.visible_text,
            outcome.output_ids,
            outcome.finish_reason,
            self._usage(prompt_ids, outcome),
            logprobs,
            self._call_info(execution, agent, role, outcome),
        )
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
        config = self.config.limits
        limits.check_prompt_tokens(config, len(prompt_ids), "messages")
        new_tokens = len(prompt_ids) - known_tokens
        limits.check_new_tokens(config, execution, new_tokens)
        stops = StopStrings(self.codec, request.stop_strings())
        # built from checked values: model_construct spares a validation pass over a long prompt
        engine_request = EngineCompletionRequest.model_construct(
            prompt=prompt_ids,
            max_tokens=min(
                request.requested_max_tokens() or config.default_max_tokens, config.max_tokens_cap
            ),
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            stop_token_ids=stops.engine_stop_ids,
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
        gyre = choice.gyre or GyreChoice()
        out = stops.apply(
            list(choice.token_ids),
            list(choice.logprobs.token_logprobs) if choice.logprobs else [],
            list(gyre.policy_versions),
            choice.finish_reason,
        )
        self.stats.stop_string_cuts += out.cut
        engine = result.engine
        version = min(out.versions) if out.versions else (engine.policy_version or 0)
        engine_id = engine.engine_id  # the engine's own id (Router.connect), as in routing and stats
        migrated = result.migrated or gyre.migrated
        call_id = execution.call_base + execution.calls
        # the numbering before the await: concurrent calls of one execution get their ids, and reach the
        # recording thread (FIFO), in this order
        execution.calls += 1
        execution.taken_tokens += new_tokens + len(out.ids)
        agent.calls += 1
        agent.last_sequence = prompt_ids + out.ids
        self.stats.calls += 1
        self.stats.prompt_tokens += len(prompt_ids)
        self.stats.output_tokens += len(out.ids)
        self.stats.migrated_calls += migrated
        await self.recording.record_call(
            self.registry.target(execution),
            execution.execution_id,
            agent.agent_id,
            role,
            prompt_ids,
            out.ids,
            out.logprobs,
            version,
            call_id=call_id,
            engine_id=engine_id,
            finish_reason=out.finish_reason,
            migrated=migrated,
            t_start=t_start,
            t_end=t_end,
        )
        return CallOutcome(
            out.ids, out.logprobs, out.text, out.finish_reason, engine_id, version, call_id, result
        )

    async def _tokenize(self, chars: int, work: Callable[..., Any], *args: Any) -> Any:
        """Runs ``work`` (a context plan, an encode) on a tokenizer thread when the prompt is large, so the
        event loop keeps serving; small prompts stay inline (a thread hop costs more than they do)."""
        if chars <= _INLINE_CHARS:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, work, *args)

    def _usage(self, prompt_ids: list[int], outcome: CallOutcome) -> dict[str, Any]:
        engine_usage = outcome.result.response.usage
        details = engine_usage.prompt_tokens_details if engine_usage is not None else None
        cached = details.cached_tokens if details is not None else None
        return usage(len(prompt_ids), len(outcome.output_ids), cached)

    def _call_info(
        self, execution: Execution, agent: Agent, role: Role, outcome: CallOutcome
    ) -> dict[str, Any]:
        return call_info(
            execution_id=execution.execution_id,
            agent_id=agent.agent_id,
            role=role,
            call_id=outcome.call_id,
            engine_id=outcome.engine_id,
            policy_version=outcome.policy_version,
            migrated=outcome.result.migrated,
            rerouted=outcome.result.rerouted,
            recomputed_tokens=outcome.result.recomputed_tokens,
        )


def _check_sampling(request: SamplingFields) -> None:
    if request.n != 1:
        raise GatewayError(400, "n > 1 is not supported: send n requests", param="n")
