"""The JSONL interchange (DESIGN.md section 4): import derives the delta encoding, export rebuilds.

One object per line: ``{"type": "execution", ...}`` or ``{"type": "call", ...}`` with the FULL
prompt ids. Import streams the file through a Recorder: a line that does not parse, or a record
that fails validation, is quarantined with its line number and reason; everything valid lands.
A line that does not parse is kept as its first 4 KiB, its size and its sha256 (the source file
holds the rest): a 200 MB garbage line must not become a 200 MB quarantine entry.

Importing ids the store already holds is checked against what it holds (StoredExecutions): a
record repeated exactly is a no-op, calls after the stored ones are added (an interrupted import
completing), and a record that would change a stored one (a token, a logprob, the reward) is
refused and quarantined with an error naming the execution, the call and the field. Nothing
stored is ever rewritten by an import.
Export rebuilds every call's prompt from the delta encoding and checks it against context_hash, so
``export(import(f))`` gives back the same records (logprobs as the float32 values engines produce).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from trajectory_store.parts import bare_connection, naming_bad_parts
from trajectory_store.recorder import Recorder
from trajectory_store.schema import (
    EXECUTION_RECORD_FIELDS,
    SCHEMAS,
    CallRecord,
    ExecutionRecord,
    RecordError,
    context_hash,
)
from trajectory_store.storage import Store

MAX_LINE_BYTES = 1 << 30  # a single record above 1 GiB is refused rather than parsed
RAW_HEAD_BYTES = 4096  # what quarantine keeps of a line that does not parse


@dataclass
class ImportReport:
    path: str
    step: int
    lines: int = 0
    executions: int = 0
    calls: int = 0
    naive_tokens: int = 0
    unique_tokens: int = 0
    quarantined: int = 0
    unchanged: int = 0  # records the store already held exactly: not written again
    errors: list[str] = field(default_factory=list)  # the first few, for the console


def import_jsonl(
    store: Store, path: str, step: int | None = None, *, max_errors_kept: int = 20
) -> ImportReport:
    """Imports one JSONL file: as step ``step``, or at each record's own "step" (default 0)."""
    report = ImportReport(path=str(path), step=step)
    recorders: dict[int, Recorder] = {}
    stored = StoredExecutions(store)

    def recorder_for(record: Any) -> Recorder:
        at = step
        if at is None:
            value = record.get("step", 0) if isinstance(record, dict) else 0
            at = value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
        if at not in recorders:
            recorders[at] = Recorder(store, at, guard=stored)
        return recorders[at]

    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            report.lines += 1
            if not line.strip():
                continue
            source = {"source": str(path), "line": number}
            try:
                _import_line(recorder_for, line, source, report)
            except RecordError as error:
                report.quarantined += 1
                if len(report.errors) < max_errors_kept:
                    report.errors.append(f"{path}:{number}: {error}")
    for recorder in recorders.values():
        recorder.close()
    report.unchanged = stored.unchanged
    return report


def _import_line(recorder_for: Any, line: bytes, source: dict[str, Any], report: ImportReport) -> None:
    if len(line) > MAX_LINE_BYTES:
        error = RecordError(f"line is {len(line)} bytes, above the {MAX_LINE_BYTES} limit")
        recorder_for(None).reject(error, _raw_line(line), source)
        raise error
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        error = RecordError(f"not valid JSON (truncated line?): {exc}")
        recorder_for(None).reject(error, _raw_line(line), source)
        raise error from None
    if not isinstance(record, dict):
        error = RecordError("a line must hold one JSON object")
        recorder_for(None).reject(error, record, source)
        raise error
    recorder = recorder_for(record)
    kind = record.get("type")
    if kind == "call":
        done = recorder.record_call_dict(record, source=source)
        report.calls += 1
        report.naive_tokens += len(record["prompt_ids"]) + len(record["output_ids"])
        report.unique_tokens += done.n_new_tokens
    elif kind == "execution":
        recorder.record_execution_dict(record, source=source)
        report.executions += 1
    else:
        error = RecordError(
            f"unknown record type {kind!r} (expected 'execution' or 'call')",
            execution_id=record.get("execution_id"),
            field="type",
        )
        recorder.reject(error, record, source)
        raise error


def _raw_line(line: bytes) -> dict[str, Any]:
    """What quarantine keeps of an unparsed line: its head, its size and its hash, never all of it."""
    return {
        "raw": line[:RAW_HEAD_BYTES].decode(errors="replace"),
        "raw_bytes": len(line),
        "raw_truncated": len(line) > RAW_HEAD_BYTES,
        "raw_sha256": hashlib.sha256(line).hexdigest(),
    }


_CALL_FIELDS = (
    "agent_id",
    "role",
    "policy_version",
    "engine_id",
    "finish_reason",
    "migrated",
    "t_start",
    "t_end",
)


class StoredExecutions:
    """What the store already holds of the executions an import names (the Recorder's guard).

    Opening it reads one column (execution_id) of every visible part; an execution's stored calls
    and rows are read when the import first reaches it, and the calls of the last few executions
    are kept (imports come grouped by execution). An empty store costs nothing.
    """

    _KEEP = 4  # executions whose stored calls stay in memory

    def __init__(self, store: Store):
        self.store = store
        self._parts = {
            kind: [store.url(p) for p in store.visible_parts(kind)] for kind in ("calls", "executions")
        }
        self.ids: set[str] = set()
        self.unchanged = 0  # records the store already held exactly (not written again)
        self._con = bare_connection(store) if any(self._parts.values()) else None
        self._calls: OrderedDict[str, dict[int, tuple[dict[str, Any], np.ndarray]]] = OrderedDict()
        self._rows: dict[str, list[dict[str, Any]]] = {}
        for urls in self._parts.values():
            if urls:
                self.ids.update(r[0] for r in self._query(f"SELECT DISTINCT execution_id FROM {_scan(urls)}"))

    def _query(self, sql: str, params: list[Any] | None = None) -> list[tuple]:
        with naming_bad_parts(self.store):
            return self._con.execute(sql, params or []).fetchall()

    def _arrow(self, sql: str, params: list[Any]) -> pa.Table:
        with naming_bad_parts(self.store):
            return self._con.sql(sql, params=params).fetch_arrow_table()

    def stored_calls(self, execution_id: str) -> dict[int, tuple[dict[str, Any], np.ndarray]]:
        """call_id -> (stored row, full sequence) of one execution (the copy the views show)."""
        if execution_id in self._calls:
            self._calls.move_to_end(execution_id)
            return self._calls[execution_id]
        urls = self._parts["calls"]
        calls: dict[int, tuple[dict[str, Any], np.ndarray]] = {}
        if urls:
            table = self._arrow(
                f"SELECT {', '.join(SCHEMAS['calls'].names)} FROM {_scan(urls)} WHERE execution_id = ? "
                "QUALIFY row_number() OVER (PARTITION BY call_id ORDER BY step, filename) = 1",
                [execution_id],
            )
            calls = {row["call_id"]: (row, sequence) for row, sequence in rebuild_sequences(table)}
        self._calls[execution_id] = calls
        if len(self._calls) > self._KEEP:
            self._calls.popitem(last=False)
        return calls

    def stored_rows(self, execution_id: str) -> list[dict[str, Any]]:
        """Every stored row of one execution, the one the executions view shows first."""
        if execution_id not in self._rows:
            urls = self._parts["executions"]
            self._rows[execution_id] = (
                self._arrow(
                    f"SELECT {', '.join(SCHEMAS['executions'].names)} FROM {_scan(urls)} "
                    "WHERE execution_id = ? ORDER BY step DESC, ended_at DESC NULLS LAST, filename",
                    [execution_id],
                ).to_pylist()
                if urls
                else []
            )
        return self._rows[execution_id]

    def check_call(self, call: CallRecord, call_id: int, step: int) -> bool:
        """True if the store holds this call exactly; RecordError if it holds another one."""
        if call.execution_id not in self.ids:
            return False
        calls = self.stored_calls(call.execution_id)
        if call_id not in calls:
            # calls after the stored ones complete an interrupted import; an execution whose row
            # says it has all its calls already gets none added
            rows = self.stored_rows(call.execution_id)
            n_calls = rows[0]["n_calls"] if rows else None
            if n_calls is not None and len(calls) >= n_calls:
                raise _changed(
                    f"the store holds this execution whole, with {n_calls} calls; this call is not one of them",
                    call.execution_id,
                    call_id,
                    "call_id",
                )
            return False
        row, sequence = calls[call_id]
        prompt_len = row["prompt_len"]
        arrays = {
            "prompt_ids": (sequence[:prompt_len], call.prompt_ids),
            "output_ids": (sequence[prompt_len:], call.output_ids),
            "output_logprobs": (
                np.asarray(row["output_logprobs"], np.float32),
                np.asarray(call.output_logprobs, np.float32),
            ),
        }
        for name, (was, given) in arrays.items():
            if not np.array_equal(was, given):
                raise _changed(_array_difference(was, given), call.execution_id, call_id, name)
        scalars = {name: (row[name], getattr(call, name)) for name in _CALL_FIELDS}
        scalars["step"] = (row["step"], step)
        for name, (was, given) in scalars.items():
            if was != given:
                raise _changed(f"stored {was!r}, here {given!r}", call.execution_id, call_id, name)
        self.unchanged += 1
        return True

    def check_execution(self, record: ExecutionRecord, step: int) -> bool:
        """True if the store holds this row exactly; RecordError if it holds another one."""
        if record.execution_id not in self.ids:
            return False
        rows = self.stored_rows(record.execution_id)
        given = {name: getattr(record, name) for name in EXECUTION_RECORD_FIELDS}
        given["step"] = step
        if record.n_calls is None:
            del given["n_calls"]  # the recorder counts the calls it saw; the calls are checked one by one
        for row in rows:
            if all(row[name] == value for name, value in given.items()):
                self.unchanged += 1
                return True
        if not rows:
            return False  # only calls were stored (an interrupted import): the row is new
        name = next(name for name, value in given.items() if rows[0][name] != value)
        raise _changed(f"stored {rows[0][name]!r}, here {given[name]!r}", record.execution_id, None, name)


def _scan(urls: list[str]) -> str:
    listing = ", ".join("'" + url.replace("'", "''") + "'" for url in urls)
    return f"read_parquet([{listing}], union_by_name=true, filename=true)"


def _array_difference(was: np.ndarray, given: np.ndarray) -> str:
    if len(was) != len(given):
        return f"stored {len(was)} values, here {len(given)}"
    at = int(np.flatnonzero(was != given)[0])
    return f"at position {at}: stored {was[at].item()!r}, here {given[at].item()!r}"


def _changed(detail: str, execution_id: str, call_id: int | None, name: str) -> RecordError:
    return RecordError(
        f"differs from what the store holds ({detail}); a re-import never changes a stored "
        "execution: import changed data under new execution ids, or into another --campaign",
        execution_id=execution_id,
        call_id=call_id,
        field=name,
    )


def rebuild_sequences(calls: pa.Table) -> Iterator[tuple[dict[str, Any], np.ndarray]]:
    """Yields (call row, full sequence) for one execution's calls, checking each prompt's hash."""
    rows = calls.sort_by("call_id").to_pylist()
    sequences: dict[int, np.ndarray] = {}
    for row in rows:
        new_ids = np.asarray(row["new_ids"], dtype=np.int32)
        parent = row["parent_call_id"]
        if parent is None:
            sequence = new_ids
        elif parent in sequences:
            sequence = np.concatenate([sequences[parent][: row["prefix_len"]], new_ids])
        else:
            raise RecordError(
                f"parent call {parent} is missing from the store",
                execution_id=row["execution_id"],
                call_id=row["call_id"],
                field="parent_call_id",
            )
        if context_hash(sequence[: row["prompt_len"]]) != row["context_hash"]:
            raise RecordError(
                "the rebuilt prompt does not match the stored context_hash",
                execution_id=row["execution_id"],
                call_id=row["call_id"],
                field="context_hash",
            )
        sequences[row["call_id"]] = sequence
        yield row, sequence


def rebuild_prompt(store: Store, execution_id: str, call_id: int) -> np.ndarray:
    """The exact prompt token ids of one call, checked against its context_hash."""
    calls = store.read_table("calls").filter(pa.compute.equal(pa.compute.field("execution_id"), execution_id))
    for row, sequence in rebuild_sequences(_dedupe_calls(calls)):
        if row["call_id"] == call_id:
            return sequence[: row["prompt_len"]]
    raise RecordError("no such call in the store", execution_id=execution_id, call_id=call_id)


def _dedupe_calls(calls: pa.Table) -> pa.Table:
    keys = list(
        zip(calls.column("execution_id").to_pylist(), calls.column("call_id").to_pylist(), strict=True)
    )
    seen: set[tuple[str, int]] = set()
    keep = []
    for i, key in enumerate(keys):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return calls.take(keep) if len(keep) != len(keys) else calls


def export_jsonl(store: Store, out_path: str) -> dict[str, int]:
    """Writes every execution and call of the store's campaign as JSONL; returns counts."""
    executions = store.read_table("executions").to_pylist()
    latest: dict[str, dict[str, Any]] = {}
    for row in sorted(executions, key=lambda r: (r["step"], r["ended_at"] or 0.0)):
        latest[row["execution_id"]] = row
    calls = _dedupe_calls(store.read_table("calls"))
    by_execution: dict[str, list[int]] = {}
    for i, execution_id in enumerate(calls.column("execution_id").to_pylist()):
        by_execution.setdefault(execution_id, []).append(i)
    counts = {"executions": 0, "calls": 0}
    with open(out_path, "wb") as out:
        for execution_id in sorted(set(latest) | set(by_execution)):
            if execution_id in latest:
                row = latest[execution_id]
                record = {"type": "execution", **{k: v for k, v in row.items() if k != "schema_version"}}
                out.write(orjson.dumps(record) + b"\n")
                counts["executions"] += 1
            if execution_id not in by_execution:
                continue
            for row, sequence in rebuild_sequences(calls.take(by_execution[execution_id])):
                prompt_len = row["prompt_len"]
                record = {
                    "type": "call",
                    "execution_id": execution_id,
                    "call_id": row["call_id"],
                    "agent_id": row["agent_id"],
                    "role": row["role"],
                    "prompt_ids": sequence[:prompt_len],
                    "output_ids": sequence[prompt_len:],
                    "output_logprobs": np.asarray(row["output_logprobs"], dtype=np.float32).astype(
                        np.float64
                    ),
                    "policy_version": row["policy_version"],
                    "engine_id": row["engine_id"],
                    "finish_reason": row["finish_reason"],
                    "migrated": row["migrated"],
                    "t_start": row["t_start"],
                    "t_end": row["t_end"],
                    "step": row["step"],
                    "context_hash": row["context_hash"],
                }
                out.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
                counts["calls"] += 1
    return counts
