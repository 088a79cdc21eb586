"""The recorder: the API the gateway calls for every model call, buffered and flushed in batches.

    recorder = Recorder(Store(StoreConfig(data_root="./gyre-data")), step=0)
    recorder.record_call("exec-1", agent_id="main", role="main", prompt_ids=[...], output_ids=[...],
                         output_logprobs=[...], policy_version=3)
    recorder.record_execution("exec-1", status="completed", reward=1.0, problem_id="p1", group_id="g1")
    recorder.flush()   # parts, then the manifest that makes them visible

Each call is stored as a delta against the earlier call of the same execution that shares the
longest prefix with it (see prefix.py). A record that fails validation is quarantined with its
reason, the error is raised to the caller, and everything valid is still written. A guard (the
JSONL import passes one: interchange.StoredExecutions) can refuse a valid record the same way, e.g.
one that would change what the store already holds.

With ``spool`` (a local file), every buffered row is also appended to that file as a JSON line
before it can be lost: a process killed between two flushes (SIGKILL included: the lines are in
the OS's page cache) leaves its unflushed rows there, and a Recorder opened on the same spool
later writes them at its first flush. A flush empties the spool once its manifest is committed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from trajectory_store.prefix import PrefixIndex
from trajectory_store.schema import (
    CALLS_SCHEMA,
    EXECUTIONS_SCHEMA,
    SCHEMA_VERSION,
    CallRecord,
    ExecutionRecord,
    RecordError,
    validate_call,
    validate_execution,
)
from trajectory_store.storage import Store, ids_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordedCall:
    execution_id: str
    call_id: int
    parent_call_id: int | None
    prefix_len: int
    n_new_tokens: int
    context_hash: str


@dataclass
class FlushReport:
    calls: int = 0
    executions: int = 0
    quarantined: int = 0
    parts: list[str] = field(default_factory=list)
    manifest: str | None = None


class RecordGuard(Protocol):
    """Checks a validated record before it is recorded: raises RecordError to refuse it, returns
    True when the store already holds it exactly (it is then not written again)."""

    def check_call(self, call: CallRecord, call_id: int, step: int) -> bool: ...

    def check_execution(self, record: ExecutionRecord, step: int) -> bool: ...


@dataclass
class _ExecutionState:
    index: PrefixIndex = field(default_factory=PrefixIndex)
    next_call_id: int = 0
    hashes: dict[int, str] = field(default_factory=dict)  # call_id -> hash of the whole sequence


class Recorder:
    """Thread-safe; one instance per (campaign, step)."""

    def __init__(
        self,
        store: Store,
        step: int,
        *,
        flush_calls: int = 2048,
        flush_tokens: int = 8_000_000,
        guard: RecordGuard | None = None,
        spool: str | None = None,
    ):
        self.store = store
        self.step = step
        self.guard = guard
        self.flush_calls = flush_calls
        self.flush_tokens = flush_tokens
        self._lock = threading.RLock()
        self._executions: dict[str, _ExecutionState] = {}
        self._call_rows: list[dict[str, Any]] = []
        self._buffered_tokens = 0
        self._execution_rows: dict[str, dict[str, Any]] = {}
        self._quarantine: list[dict[str, Any]] = []
        self.totals = FlushReport()
        self._replayed_executions: dict[str, dict[str, Any]] = {}  # rows from a spool, final already
        self.replayed = 0  # rows read back from the spool
        self._spool = None
        if spool is not None:
            os.makedirs(os.path.dirname(spool) or ".", exist_ok=True)
            if os.path.exists(spool):
                self._replay(spool)
            self._spool = open(spool, "a", encoding="utf-8")  # noqa: SIM115  (open for the recorder's life)
            if self._spool.tell() > 0:
                self._spool.write("\n")  # a torn last line stays a line of its own

    # -- calls ---------------------------------------------------------------------------------
    def record_call(
        self,
        execution_id: str,
        agent_id: str,
        role: str,
        prompt_ids: Any,
        output_ids: Any,
        output_logprobs: Any,
        policy_version: int,
        *,
        call_id: int | None = None,
        engine_id: str | None = None,
        finish_reason: str | None = None,
        migrated: bool = False,
        t_start: float | None = None,
        t_end: float | None = None,
        context_hash: str | None = None,
    ) -> RecordedCall:
        raw = {
            "execution_id": execution_id,
            "call_id": call_id,
            "agent_id": agent_id,
            "role": role,
            "prompt_ids": prompt_ids,
            "output_ids": output_ids,
            "output_logprobs": output_logprobs,
            "policy_version": policy_version,
            "engine_id": engine_id,
            "finish_reason": finish_reason,
            "migrated": migrated,
            "t_start": t_start,
            "t_end": t_end,
            "context_hash": context_hash,
        }
        return self.record_call_dict(raw)

    def record_call_dict(self, raw: dict[str, Any], *, source: dict[str, Any] | None = None) -> RecordedCall:
        """Validates and records one call given as a dict (the JSONL interchange form)."""
        try:
            call = validate_call(raw, self.store.config.vocab_size)
            with self._lock:
                return self._add_call(call)
        except RecordError as error:
            self.reject(error, raw, source)
            raise

    def _add_call(self, call: CallRecord) -> RecordedCall:
        state = self._executions.setdefault(call.execution_id, _ExecutionState())
        sequence = call.sequence()
        call_id = state.next_call_id if call.call_id is None else call.call_id
        prompt_hash, sequence_hash = _hashes(call.prompt_ids, call.output_ids)
        if call_id in state.index:
            # the same call twice (a retried writer) is a no-op; a different one is an error
            if state.hashes[call_id] == sequence_hash:
                return RecordedCall(call.execution_id, call_id, None, 0, 0, prompt_hash)
            raise RecordError(
                "call_id already recorded with different tokens",
                execution_id=call.execution_id,
                call_id=call_id,
                field="call_id",
            )
        if call_id < state.next_call_id:
            raise RecordError(
                f"calls must arrive in call_id order; call {state.next_call_id - 1} was already recorded",
                execution_id=call.execution_id,
                call_id=call_id,
                field="call_id",
            )
        stored = self.guard is not None and self.guard.check_call(call, call_id, self.step)
        attachment, new_ids = state.index.insert(call_id, sequence)
        state.next_call_id = call_id + 1
        state.hashes[call_id] = sequence_hash
        if stored:  # indexed, so later calls delta-encode against it, but not written again
            return RecordedCall(
                call.execution_id, call_id, attachment.parent_call_id, attachment.prefix_len, 0, prompt_hash
            )
        self._call_rows.append(
            {
                "execution_id": call.execution_id,
                "call_id": call_id,
                "step": self.step,
                "agent_id": call.agent_id,
                "role": call.role,
                "parent_call_id": attachment.parent_call_id,
                "prefix_len": attachment.prefix_len,
                "new_ids": new_ids,
                "prompt_len": len(call.prompt_ids),
                "output_len": len(call.output_ids),
                "output_logprobs": call.output_logprobs,
                "policy_version": call.policy_version,
                "engine_id": call.engine_id,
                "context_hash": prompt_hash,
                "finish_reason": call.finish_reason,
                "migrated": call.migrated,
                "t_start": call.t_start,
                "t_end": call.t_end,
                "schema_version": SCHEMA_VERSION,
            }
        )
        self._buffered_tokens += len(new_ids) + len(call.output_ids)
        self._spooled("call", self._call_rows[-1])
        if len(self._call_rows) >= self.flush_calls or self._buffered_tokens >= self.flush_tokens:
            self.flush()
        return RecordedCall(
            call.execution_id,
            call_id,
            attachment.parent_call_id,
            attachment.prefix_len,
            len(new_ids),
            prompt_hash,
        )

    # -- executions ----------------------------------------------------------------------------
    def calls_of(self, execution_id: str) -> int:
        """How many calls of the execution this recorder has taken (what its row's n_calls counts)."""
        state = self._executions.get(execution_id)
        return 0 if state is None else len(state.hashes)

    def record_execution(self, execution_id: str, status: str, **fields: Any) -> None:
        """Records (or replaces, until flushed) the execution's row; its prefix index is released."""
        self.record_execution_dict({"execution_id": execution_id, "status": status, **fields})

    def record_execution_dict(self, raw: dict[str, Any], *, source: dict[str, Any] | None = None) -> None:
        try:
            record = validate_execution(raw)
            stored = self.guard is not None and self.guard.check_execution(record, self.step)
        except RecordError as error:
            self.reject(error, raw, source)
            raise
        if stored:
            return
        with self._lock:
            self._execution_rows[record.execution_id] = record
            self._replayed_executions.pop(record.execution_id, None)
            if self._spool is not None:
                self._spooled("execution", self._execution_row(record))

    # -- quarantine and flushing ---------------------------------------------------------------
    def reject(self, error: RecordError, raw: Any, source: dict[str, Any] | None = None) -> None:
        entry = {**error.as_dict(), "record": _jsonable(raw)}
        if source:
            entry.update(source)
        with self._lock:
            self._quarantine.append(entry)
            self.totals.quarantined += 1

    def flush(self) -> FlushReport:
        """Writes buffered rows as Parquet parts, then the manifest that makes them visible."""
        with self._lock:
            report = FlushReport()
            parts: dict[str, list[str]] = {}
            rows: dict[str, int] = {}
            if self._call_rows:
                table = _calls_table(self._call_rows)
                key = ids_key([(r["execution_id"], r["call_id"]) for r in self._call_rows])
                parts["calls"] = [self.store.write_part("calls", self.step, table, key)]
                rows["calls"] = report.calls = len(self._call_rows)
            if self._execution_rows or self._replayed_executions:
                rows_by_id = {**self._replayed_executions}
                rows_by_id.update({k: self._execution_row(r) for k, r in self._execution_rows.items()})
                ordered = [rows_by_id[k] for k in sorted(rows_by_id)]
                table = pa.Table.from_pylist(ordered, schema=EXECUTIONS_SCHEMA)
                # the key covers every field: a re-recorded row (a later status, a new reward) is a
                # new part beside the old one, never an overwrite of it (the view keeps the latest)
                key = ids_key([tuple(r.values()) for r in ordered])
                parts["executions"] = [self.store.write_part("executions", self.step, table, key)]
                rows["executions"] = report.executions = len(ordered)
            if self._quarantine:
                report.quarantined = len(self._quarantine)
                self.store.quarantine(self.step, self._quarantine)
            if parts:
                report.parts = [p for paths in parts.values() for p in paths]
                report.manifest = self.store.commit(self.step, parts, rows)
            self._call_rows = []
            self._buffered_tokens = 0
            self._execution_rows = {}
            self._replayed_executions = {}
            self._quarantine = []
            if self._spool is not None:  # everything in it is committed now
                self._spool.truncate(0)
            self.totals.calls += report.calls
            self.totals.executions += report.executions
            self.totals.parts += report.parts
            return report

    def _execution_row(self, record: ExecutionRecord) -> dict[str, Any]:
        n_calls = record.n_calls
        state = self._executions.get(record.execution_id)
        if n_calls is None and state is not None:
            n_calls = len(state.hashes)
        return _execution_row(record, self.step, n_calls)

    # -- the spool -----------------------------------------------------------------------------
    def _spooled(self, kind: str, row: dict[str, Any]) -> None:
        if self._spool is not None:
            self._spool.write(json.dumps({"kind": kind, "row": _jsonable(row)}) + "\n")
            self._spool.flush()  # to the OS: survives the process being killed

    def _replay(self, path: str) -> None:
        """Buffers the rows a killed predecessor left in the spool (a torn last line is dropped)."""
        with open(path, encoding="utf-8") as spool:
            lines = spool.read().splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                logger.warning("%s line %d is torn (the writer died mid-line): dropped", path, number)
                continue
            row = entry["row"]
            if entry["kind"] == "call":
                self._call_rows.append(row)
                self._buffered_tokens += len(row["new_ids"]) + row["output_len"]
                state = self._executions.setdefault(row["execution_id"], _ExecutionState())
                # later calls of that execution must not reuse these ids (they would be refused)
                state.next_call_id = max(state.next_call_id, row["call_id"] + 1)
                state.hashes[row["call_id"]] = row["context_hash"]  # counted in the execution's n_calls
            else:
                self._replayed_executions[row["execution_id"]] = row
            self.replayed += 1
        if self.replayed:
            logger.warning(
                "%s: %d rows left by a recorder that died, written at the next flush", path, self.replayed
            )

    def forget(self, execution_id: str) -> None:
        """Releases an execution's prefix index (after its last call)."""
        with self._lock:
            self._executions.pop(execution_id, None)

    def close(self) -> FlushReport:
        report = self.flush()
        with self._lock:
            self._executions.clear()
            if self._spool is not None:
                self._spool.close()
                self._spool = None
        return report


def _hashes(prompt_ids: np.ndarray, output_ids: np.ndarray) -> tuple[str, str]:
    """(context_hash of the prompt, hash of prompt + output) in one pass over the tokens."""
    digest = hashlib.blake2b(np.ascontiguousarray(prompt_ids, dtype="<i4").tobytes(), digest_size=16)
    prompt_hash = digest.hexdigest()
    digest.update(np.ascontiguousarray(output_ids, dtype="<i4").tobytes())
    return prompt_hash, digest.hexdigest()


def _calls_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Builds the calls table column by column: list columns from one concatenated buffer each."""
    columns: dict[str, Any] = {}
    for name in CALLS_SCHEMA.names:
        kind = CALLS_SCHEMA.field(name).type
        if pa.types.is_list(kind):
            arrays = [r[name] for r in rows]
            offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
            np.cumsum([len(a) for a in arrays], out=offsets[1:])
            dtype = np.int32 if name == "new_ids" else np.float32
            values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
            columns[name] = pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(values, type=kind.value_type)
            )
        else:
            columns[name] = pa.array([r[name] for r in rows], type=kind)
    return pa.Table.from_pydict(columns, schema=CALLS_SCHEMA)


def _execution_row(record: ExecutionRecord, step: int, n_calls: int | None) -> dict[str, Any]:
    return {
        "execution_id": record.execution_id,
        "problem_id": record.problem_id,
        "group_id": record.group_id,
        "step": step,
        "harness": record.harness,
        "status": record.status,
        "reward": record.reward,
        "reward_source": record.reward_source,
        "snapshot_uri": record.snapshot_uri,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "n_calls": n_calls,
        "schema_version": SCHEMA_VERSION,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
