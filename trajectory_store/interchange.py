"""The JSONL interchange (DESIGN.md section 4): import derives the delta encoding, export rebuilds.

One object per line: ``{"type": "execution", ...}`` or ``{"type": "call", ...}`` with the FULL
prompt ids. Import streams the file through a Recorder: a line that does not parse, or a record
that fails validation, is quarantined with its line number and reason; everything valid lands.
Export rebuilds every call's prompt from the delta encoding and checks it against context_hash, so
``export(import(f))`` gives back the same records (logprobs as the float32 values engines produce).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from trajectory_store.recorder import Recorder
from trajectory_store.schema import RecordError, context_hash
from trajectory_store.storage import Store

MAX_LINE_BYTES = 1 << 30  # a single record above 1 GiB is refused rather than parsed


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
    errors: list[str] = field(default_factory=list)  # the first few, for the console


def import_jsonl(
    store: Store, path: str, step: int | None = None, *, max_errors_kept: int = 20
) -> ImportReport:
    """Imports one JSONL file: as step ``step``, or at each record's own "step" (default 0)."""
    report = ImportReport(path=str(path), step=step)
    recorders: dict[int, Recorder] = {}

    def recorder_for(record: Any) -> Recorder:
        at = step
        if at is None:
            value = record.get("step", 0) if isinstance(record, dict) else 0
            at = value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
        if at not in recorders:
            recorders[at] = Recorder(store, at)
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
    return report


def _import_line(recorder_for: Any, line: bytes, source: dict[str, Any], report: ImportReport) -> None:
    if len(line) > MAX_LINE_BYTES:
        error = RecordError(f"line is {len(line)} bytes, above the {MAX_LINE_BYTES} limit")
        recorder_for(None).reject(error, {"raw_prefix": line[:200].decode(errors="replace")}, source)
        raise error
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        error = RecordError(f"not valid JSON (truncated line?): {exc}")
        recorder_for(None).reject(error, {"raw": line.decode(errors="replace")}, source)
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
