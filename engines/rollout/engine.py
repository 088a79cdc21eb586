"""RolloutEngine: continuous batching over per-session KV caches, one ``step()`` at a time.

    engine = RolloutEngine(model_or_hf_folder, EngineConfig(max_batch_size=32))
    engine.add_request(GenerateRequest(request_id="r1", session_id="s1", prompt_ids=[...]))
    while engine.has_unfinished():
        for output in engine.step():      # GenerateOutput: output ids, raw logprobs, policy versions
            ...
    engine.generate([request, ...])       # the same loop, outputs in request order

One step: (1) take newly added requests and aborts; (2) admit waiting requests while rows and KV
budget allow, prefilling each one's prompt minus what its session's cache already holds (a prompt
that extends the cached tokens prefills only the new suffix; one that diverges reuses the longest
common prefix and truncates the cache there) and sampling its first token; (3) ONE batched decode
forward for every running request (right-padded KV rows, per-row positions, a 4D mask; the padded
batch is rebuilt only when its composition changes); (4) evict idle sessions' KV, least recently
used first, beyond ``kv_budget_tokens``. Requests join and leave between steps.

Between steps (the engine lock makes these wait for a running step):
    update_weights(state_dict, version)   hot swap; sessions and their KV stay (the cached KV was
                                          computed by the old weights, as in vLLM async-RL setups);
                                          drop_kv=True recomputes every context with the new weights
    sleep() / wake(weights)               free weights + KV, keep token histories; re-prefill on demand
    export_session / import_session       KV migration between engines (migration.py)

Sampling and logprobs: sampling.py. The model forwards: runner.py. Thread safety: ``add_request`` and
``abort`` may be called from any thread; everything else holds the engine lock.
"""

from __future__ import annotations

import os
import threading
from collections import deque

import torch

from engines.admin import EngineCounters
from engines.model.weights import read_weights
from engines.protocol import common_prefix
from engines.rollout.config import EngineConfig
from engines.rollout.kv import DecodeBatch, KVRows
from engines.rollout.messages import FinishReason, GenerateOutput, GenerateRequest
from engines.rollout.migration import DecodeState, SessionState
from engines.rollout.runner import ModelRunner
from engines.rollout.sampling import request_generator, sample_rows
from engines.rollout.state import RequestState, Session


class RolloutEngine:
    """Attributes, as a table of contents:

    config          EngineConfig
    runner          ModelRunner: the model, its KV shape, prefill/decode forwards, weight swaps
    policy_version  version of the loaded weights, stamped on every sampled token
    stats           EngineCounters (engines/admin.py: what /admin/stats carries)
    sessions        session id -> Session (token history + KV)
    waiting         requests not yet prefilled (FIFO), including resumes after sleep / drop_kv
    running         requests decoding, in the row order of the decode batch
    batch           DecodeBatch: the running requests' padded KV (kv.py)
    """

    def __init__(
        self, model_or_path: torch.nn.Module | str | os.PathLike, config: EngineConfig | None = None
    ):
        self.config = config or EngineConfig()
        self.runner = ModelRunner(model_or_path, self.config)
        self.policy_version = self.config.policy_version
        self.stats = EngineCounters()
        self.sessions: dict[str, Session] = {}
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.batch = DecodeBatch(self.runner.shape)
        self._inbox: list[RequestState] = []
        self._live: set[str] = set()  # ids of requests added and not yet ended
        self._aborts: list[str] = []
        self._inbox_lock = threading.Lock()
        self._lock = threading.RLock()
        self._done: list[GenerateOutput] = []  # ended outside step() (abort, export); next step returns them
        self._tick = 0

    # public API -------------------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        """Queues a request (any thread). Raises ValueError for a prompt the engine cannot serve."""
        if len(request.prompt_ids) >= self.runner.max_model_len:
            raise ValueError(
                f"prompt of {len(request.prompt_ids)} tokens leaves no room under max_model_len="
                f"{self.runner.max_model_len}; shorten it or raise EngineConfig.max_model_len"
            )
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self.runner.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.runner.vocab_size})")
        key = request.session_id if request.session_id is not None else f"~{request.request_id}"
        state = RequestState(
            request, request_generator(request.sampling, self.config.seed, request.request_id), key
        )
        with self._inbox_lock:
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._live.add(request.request_id)
            self._inbox.append(state)

    def abort(self, request_id: str) -> None:
        """Ends a request at the next step; that step returns it with finish_reason 'abort'."""
        with self._inbox_lock:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._inbox or self._aborts or self._done or self.waiting or self.running)

    def has_work(self) -> bool:
        """Whether step() would make progress now (an asleep engine only returns ended requests)."""
        return bool(self._inbox or self._aborts or self._done) or (
            not self.runner.asleep and bool(self.waiting or self.running)
        )

    def step(self) -> list[GenerateOutput]:
        with self._lock:
            self._tick += 1
            self.stats.steps += 1
            self._drain_inbox()
            outputs, self._done = self._done, []
            if self.runner.asleep:
                return outputs
            self._admit(outputs)
            self._decode(outputs)
            self._make_room(0)
            return outputs

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Adds the requests and steps until all of them ended; outputs in request order. For an engine
        this caller owns: outputs of other callers' requests that end meanwhile are dropped."""
        if self.runner.asleep:
            raise RuntimeError("the engine is asleep: wake() it before generating")
        for request in requests:
            self.add_request(request)
        pending = {r.request_id for r in requests}
        ended: dict[str, GenerateOutput] = {}
        while pending:
            for output in self.step():
                if output.request_id in pending:
                    pending.discard(output.request_id)
                    ended[output.request_id] = output
        return [ended[r.request_id] for r in requests]

    def abort_all(self) -> None:
        """Ends every request now (finish_reason 'abort', returned by the next step) and drops the decode
        batch: the recovery path after a failed step."""
        with self._lock:
            self._drain_inbox()
            for state in [*self.running, *self.waiting]:
                self._remove(state)
                self._done.append(self._output(state, "abort"))
            self.batch.clear()

    def end_session(self, session_id: str) -> None:
        """Forgets an idle session (its KV and history)."""
        with self._lock:
            session = self.sessions.get(session_id)
            if session is not None and session.request_id is None:
                del self.sessions[session_id]

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the engine holds now, all sessions together."""
        return sum(s.kv_len for s in self.sessions.values())

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.shape.bytes_per_token

    # weights ----------------------------------------------------------------------------------------
    def update_weights(
        self, state_dict: dict[str, torch.Tensor], version: int, *, drop_kv: bool = False
    ) -> None:
        """Loads new weights between two steps. Sessions and running requests continue: tokens sampled
        from now on carry ``version``. By default their cached KV stays as the old weights computed it
        (the approximation in-flight weight updates make in async RL on vLLM, e.g. PipelineRL); with
        ``drop_kv=True`` every cache is dropped and each context re-prefilled with the new weights
        (counted in recomputed_tokens)."""
        with self._lock:
            if self.runner.asleep:
                raise RuntimeError("the engine is asleep: wake(state_dict, version) loads weights")
            self.runner.load_weights(state_dict)
            self.policy_version = version
            self.stats.weight_updates += 1
            if drop_kv:
                self._drop_all_kv()

    def sleep(self) -> None:
        """Frees the weights and every KV cache; keeps sessions' token histories and in-flight requests,
        which re-prefill after wake() (counted as recomputed_tokens)."""
        with self._lock:
            if not self.runner.asleep:
                self._drop_all_kv()
                self.runner.free_weights()

    def wake(self, weights: dict[str, torch.Tensor] | str | os.PathLike, version: int | None = None) -> None:
        """Reloads weights from a state dict, a safetensors file or an HF folder. The version is
        ``version``, else the file's 'version' metadata, else unchanged."""
        with self._lock:
            if not self.runner.asleep:
                raise RuntimeError("the engine is awake: use update_weights() to swap weights")
            file_version = None
            if not isinstance(weights, dict):
                weights, file_version = read_weights(weights)
            self.runner.restore_weights(weights)
            if version is not None or file_version is not None:
                self.policy_version = version if version is not None else file_version

    @property
    def asleep(self) -> bool:
        return self.runner.asleep

    # migration --------------------------------------------------------------------------------------
    def export_session(self, session_id: str) -> SessionState:
        """Removes a session (and its request, if any) from this engine and returns its state. A
        request in flight ends here with finish_reason 'migrated' (returned by the next step)."""
        with self._lock:
            self._drain_inbox()
            session = self.sessions.get(session_id)
            if session is None:
                raise KeyError(f"no session {session_id!r} on engine {self.config.engine_id}")
            state = self._holder(session)
            decode = None
            if state is not None:
                decode = DecodeState.capture(state)
                self._remove(state)  # copies its KV row out of the decode batch into session.kv
                self._done.append(self._output(state, "migrated"))
            kv = session.kv.row_tensors(0) if session.kv is not None else None  # views, no copy
            self.sessions.pop(session_id, None)
            self.stats.migrations_out += 1
            return SessionState(
                session_id=session_id,
                tokens=list(session.tokens[: session.kv_len]) if kv is not None else list(session.tokens),
                kv=kv,
                signature=self.runner.shape.signature(),
                policy_version=self.policy_version,
                source_engine_id=self.config.engine_id,
                ephemeral=session.ephemeral,
                decode=decode,
            )

    def import_session(self, state: SessionState) -> None:
        """Adopts a session exported by another engine with the same model architecture. Its request
        (if any) continues at the next step from where the exporter stopped; with KV present nothing
        of the context is prefilled again."""
        shape = self.runner.shape
        state.check_compatible(shape)
        with self._lock:
            self._drain_inbox()
            old = self.sessions.get(state.session_id)
            if old is not None and old.request_id is not None:
                raise ValueError(f"session {state.session_id!r} is busy on engine {self.config.engine_id}")
            session = Session(
                state.session_id, list(state.tokens), ephemeral=state.ephemeral, last_used=self._tick
            )
            if state.kv is not None:
                layers = [
                    (k.to(shape.device, shape.dtype), v.to(shape.device, shape.dtype)) for k, v in state.kv
                ]
                session.kv, session.kv_len = KVRows.from_tensors(layers, shape), len(state.tokens)
            self.sessions[state.session_id] = session
            self._make_room(0, keep=session)
            if state.decode is not None:
                request_state = state.decode.restore(state.session_id)
                session.request_id = request_state.request_id
                with self._inbox_lock:
                    self._live.add(request_state.request_id)
                self.waiting.appendleft(request_state)  # admitted first; prefills only what KV lacks
            self.stats.migrations_in += 1

    # scheduling -------------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        self.waiting.extend(new)
        for request_id in aborts:
            state = next((s for s in [*self.waiting, *self.running] if s.request_id == request_id), None)
            if state is not None:
                self._remove(state)
                self._done.append(self._output(state, "abort"))

    def _admit(self, outputs: list[GenerateOutput]) -> None:
        running_tokens = sum(self.sessions[s.session_key].kv_len for s in self.running)
        for state in list(self.waiting):
            if len(self.running) >= self.config.max_batch_size:
                break
            session = self._session(state)
            if session.request_id not in (None, state.request_id):
                continue  # the session's previous call is still in flight
            need = len(state.context)
            if self.running and running_tokens + need > self.config.kv_budget_tokens:
                break
            self.waiting.remove(state)
            session.request_id = state.request_id
            self._make_room(need - session.kv_len, keep=session)
            self._prefill(state, session, outputs)
            running_tokens += need

    def _prefill(self, state: RequestState, session: Session, outputs: list[GenerateOutput]) -> None:
        context = state.context
        resume = bool(state.output_ids)  # its next token is sampled already: prefill without sampling
        held = session.tokens[: session.kv_len] if session.kv is not None else []
        common = common_prefix(held, context)
        if not resume and common == len(context):
            common -= 1  # the last prompt token must run to give the next-token logits
        seen_before = min(common_prefix(session.tokens, context), len(context))
        if session.kv is None:
            session.kv = KVRows.allocate(1, len(context), self.runner.shape)
        session.kv.truncate(0, common)
        logits = None
        if common < len(context):
            logits = self.runner.prefill(session.kv, context[common:], self.config.prefill_chunk_tokens)
        session.tokens, session.kv_len, session.last_used = list(context), len(context), self._tick
        prefilled = len(context) - common
        self.stats.prefilled_tokens += prefilled
        self.stats.recomputed_tokens += max(0, seen_before - common)
        state.prefilled_tokens += prefilled
        if not state.started:
            state.started, state.cached_prompt_tokens = True, common
            self.stats.cached_tokens += common
        self.running.append(state)
        if not resume:
            token, logprob = sample_rows(logits[None], [state.request.sampling], [state.generator])
            self._record(state, token[0], logprob[0], outputs)

    def _decode(self, outputs: list[GenerateOutput]) -> None:
        if not self.running:
            self.batch.clear()
            return
        joining = {}
        for state in self.running:
            if state.request_id not in self.batch.ids:  # prefilled since the last step: its KV moves in
                session = self.sessions[state.session_key]
                joining[state.request_id], session.kv = session.kv, None
        kv = self.batch.sync([s.request_id for s in self.running], joining)
        self.stats.batch_rebuilds = self.batch.rebuilds
        logits = self.runner.decode(kv, [s.output_ids[-1] for s in self.running])  # [rows, vocab]
        self.stats.decode_steps += 1
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        for state in self.running:
            session = self.sessions[state.session_key]
            session.tokens.append(state.output_ids[-1])
            session.kv_len += 1
            session.last_used = self._tick
        tokens, logprobs = sample_rows(
            logits, [s.request.sampling for s in self.running], [s.generator for s in self.running]
        )
        for state, token, logprob in zip(list(self.running), tokens, logprobs, strict=True):
            self._record(state, token, logprob, outputs)

    def _record(self, state: RequestState, token: int, logprob: float, outputs: list[GenerateOutput]) -> None:
        state.output_ids.append(token)
        state.output_logprobs.append(logprob)
        state.policy_versions.append(self.policy_version)
        self.stats.decoded_tokens += 1
        sampling = state.request.sampling
        reason: FinishReason | None = None
        if token in sampling.stop_token_ids:
            reason = "stop"
        elif len(state.output_ids) >= sampling.max_tokens or (
            len(state.request.prompt_ids) + len(state.output_ids) >= self.runner.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self._remove(state)
            outputs.append(self._output(state, reason))

    def _remove(self, state: RequestState) -> None:
        """Takes a request out of waiting/running; its session keeps the KV (copied out of the batch)."""
        with self._inbox_lock:
            self._live.discard(state.request_id)
        session = self.sessions.get(state.session_key)
        if state in self.waiting:
            self.waiting.remove(state)
        if state in self.running:
            self.running.remove(state)
            taken = self.batch.take(state.request_id)
            if taken is not None:
                session.kv = taken
        if session is not None and session.request_id == state.request_id:
            session.request_id = None
            session.last_used = self._tick
            if session.ephemeral:
                del self.sessions[state.session_key]

    def _session(self, state: RequestState) -> Session:
        session = self.sessions.get(state.session_key)
        if session is None:
            ephemeral = state.request.session_id is None
            session = self.sessions[state.session_key] = Session(state.session_key, ephemeral=ephemeral)
        return session

    def _holder(self, session: Session) -> RequestState | None:
        for state in [*self.running, *self.waiting]:
            if state.request_id == session.request_id:
                return state
        return None

    def _make_room(self, extra: int, keep: Session | None = None) -> None:
        """Evicts idle sessions' KV, least recently used first, until the budget holds ``extra`` more."""
        total = self.kv_tokens
        if total + extra <= self.config.kv_budget_tokens:
            return
        idle = [s for s in self.sessions.values() if s.request_id is None and s.kv_len > 0 and s is not keep]
        for session in sorted(idle, key=lambda s: s.last_used):
            if total + extra <= self.config.kv_budget_tokens:
                break
            total -= session.kv_len
            session.forget_kv()
            self.stats.evictions += 1

    def _drop_all_kv(self) -> None:
        """Every session forgets its KV; running requests go back to the queue's front to resume."""
        for state in reversed(self.running):
            self.waiting.appendleft(state)
        self.running = []
        self.batch.clear()
        for session in self.sessions.values():
            session.forget_kv()

    def _output(self, state: RequestState, reason: FinishReason) -> GenerateOutput:
        return state.output(reason, self.config.engine_id)
