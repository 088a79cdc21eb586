"""Arrow schemas of the trajectory store and the validation of records on their way in and out.

Five datasets live under ``<data_root>/campaigns/<campaign>/`` (DESIGN.md section 4):

- ``executions``: one row per agent execution (status, reward, where the reward came from).
- ``calls``: one row per model call, delta-encoded against the earlier call of the same execution
  that shares the longest prefix with it, so storage grows with unique tokens, not calls x context.
- ``metrics``: one row per measured figure (step timings, cell role changes, ...).
- ``snapshots``: one row per entry (file, folder, symlink) of a workspace snapshot: a timed-out
  execution's workspace, optionally a completed one's, and the problem's starting workspace (a
  ``template`` snapshot) to compare them with; file contents by sha256 into ``blobs``.
- ``blobs``: content-addressed file contents (sha256 -> bytes), each stored once (snapshots.py).

Every row carries ``schema_version``. Validation is plain Python over numpy arrays (a record can hold
a million token ids, so no per-element model objects): a bad record raises :class:`RecordError`,
whose message names the execution, the call and the field.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1

Role = Literal["main", "sub", "main_summary", "sub_summary"]
"""Who made a call; summary roles are context-compression calls."""
Status = Literal["completed", "timeout", "error", "eval_failed", "abandoned"]
"""How an execution ended (eval_failed: the grader failed; abandoned: its dispatcher died and a new
attempt of the same group member replaced it, so its calls are kept but never trained on or graded).
"""
RewardSource = Literal["final", "workspace_snapshot", "placeholder"]
"""Where an execution's reward came from: its final workspace, a snapshot of a timed-out one, or
nothing to grade (a reward-0 placeholder)."""
ROLES: tuple[str, ...] = get_args(Role)
STATUSES: tuple[str, ...] = get_args(Status)
REWARD_SOURCES: tuple[str, ...] = get_args(RewardSource)
MAX_TOKEN_ID = 2**31 - 1  # token ids are stored as int32

EXECUTIONS_SCHEMA = pa.schema(
    [
        pa.field("execution_id", pa.string(), nullable=False),
        pa.field("problem_id", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("harness", pa.string()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("reward", pa.float64()),
        pa.field("reward_source", pa.string()),
        pa.field("snapshot_uri", pa.string()),
        pa.field("started_at", pa.float64()),
        pa.field("ended_at", pa.float64()),
        pa.field("n_calls", pa.int32()),
        pa.field("schema_version", pa.int16(), nullable=False),
    ]
)

CALLS_SCHEMA = pa.schema(
    [
        pa.field("execution_id", pa.string(), nullable=False),
        pa.field("call_id", pa.int32(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("agent_id", pa.string()),
        pa.field("role", pa.string(), nullable=False),
        # Delta encoding: sequence(call) = sequence(parent)[:prefix_len] + new_ids, where the
        # sequence of a call is its prompt followed by its output. No parent: prefix_len = 0.
        pa.field("parent_call_id", pa.int32()),
        pa.field("prefix_len", pa.int32(), nullable=False),
        pa.field("new_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),  # sequence[:prompt_len] is the prompt
        pa.field("output_len", pa.int32(), nullable=False),  # the rest is the output
        pa.field("output_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("policy_version", pa.int32(), nullable=False),
        pa.field("engine_id", pa.string()),
        pa.field("context_hash", pa.string(), nullable=False),  # of the full prompt ids
        pa.field("finish_reason", pa.string()),
        pa.field("migrated", pa.bool_(), nullable=False),
        pa.field("t_start", pa.float64()),
        pa.field("t_end", pa.float64()),
        pa.field("schema_version", pa.int16(), nullable=False),
    ]
)

METRICS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int32(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("value", pa.float64(), nullable=False),
        pa.field("cell_id", pa.string()),
        pa.field("detail", pa.string()),
        pa.field("t", pa.float64()),
        pa.field("schema_version", pa.int16(), nullable=False),
    ]
)

SnapshotSource = Literal["timeout", "final", "template"]
"""What a snapshot holds: a timed-out execution's workspace, a completed execution's final one, or a
problem's starting workspace (its template: execution_id is NULL)."""
EntryKind = Literal["file", "dir", "symlink"]
"""What one snapshot entry is (nothing else is ever stored; hard links are stored as files)."""
SNAPSHOT_SOURCES: tuple[str, ...] = get_args(SnapshotSource)
ENTRY_KINDS: tuple[str, ...] = get_args(EntryKind)

SNAPSHOTS_SCHEMA = pa.schema(
    [
        # digest of the snapshot's entries (path, kind, mode, size, sha256, link_target): the same
        # tree has the same id, whoever it belongs to
        pa.field("snapshot_id", pa.string(), nullable=False),
        pa.field("execution_id", pa.string()),  # NULL for a template
        pa.field("problem_id", pa.string()),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("source", pa.string(), nullable=False),  # SnapshotSource
        pa.field("template_id", pa.string()),  # snapshot_id of the problem's starting workspace
        pa.field("path", pa.string(), nullable=False),  # relative, '/'-separated, no '.' or '..'
        pa.field("kind", pa.string(), nullable=False),  # EntryKind
        pa.field("mode", pa.int32(), nullable=False),  # 0o644 or 0o755 (files), 0o755 (dirs), 0o777 (links)
        pa.field("size", pa.int64(), nullable=False),  # bytes of a file, 0 otherwise
        pa.field("sha256", pa.string()),  # of a file's bytes: the key into blobs; NULL otherwise
        pa.field("link_target", pa.string()),  # a symlink's relative target; NULL otherwise
        pa.field("schema_version", pa.int16(), nullable=False),
    ]
)

BLOBS_SCHEMA = pa.schema(
    [
        pa.field("sha256", pa.string(), nullable=False),
        pa.field("size", pa.int64(), nullable=False),
        pa.field("data", pa.large_binary(), nullable=False),
        pa.field("schema_version", pa.int16(), nullable=False),
    ]
)

SCHEMAS = {
    "executions": EXECUTIONS_SCHEMA,
    "calls": CALLS_SCHEMA,
    "metrics": METRICS_SCHEMA,
    "snapshots": SNAPSHOTS_SCHEMA,
    "blobs": BLOBS_SCHEMA,
}


class RecordError(ValueError):
    """A record that cannot be stored or read back; says which execution, call and field."""

    def __init__(
        self, reason: str, *, execution_id: Any = None, call_id: Any = None, field: str | None = None
    ):
        self.reason = reason
        self.execution_id = execution_id
        self.call_id = call_id
        self.field = field
        where = []
        if execution_id is not None:
            where.append(f"execution {execution_id!r}")
        if call_id is not None:
            where.append(f"call {call_id}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(f"{', '.join(where)}: {reason}" if where else reason)

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "execution_id": self.execution_id,
            "call_id": self.call_id,
            "field": self.field,
            "error": str(self),
        }


def context_hash(prompt_ids: np.ndarray) -> str:
    """Hash of a prompt's token ids (int32 little-endian); the recorder stores it per call."""
    data = np.ascontiguousarray(prompt_ids, dtype="<i4").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass
class CallRecord:
    """One model call with its FULL prompt, as the gateway or the JSONL interchange gives it."""

    execution_id: str
    call_id: int | None
    agent_id: str
    role: str
    prompt_ids: np.ndarray  # [prompt_len] int32
    output_ids: np.ndarray  # [output_len] int32
    output_logprobs: np.ndarray  # [output_len] float32
    policy_version: int
    engine_id: str | None = None
    finish_reason: str | None = None
    migrated: bool = False
    t_start: float | None = None
    t_end: float | None = None
    context_hash: str | None = None  # when given, must match the prompt

    def sequence(self) -> np.ndarray:
        return np.concatenate([self.prompt_ids, self.output_ids])


@dataclass
class ExecutionRecord:
    execution_id: str
    status: str
    problem_id: str | None = None
    group_id: str | None = None
    harness: str | None = None
    reward: float | None = None
    reward_source: str | None = None
    snapshot_uri: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    n_calls: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


EXECUTION_RECORD_FIELDS = tuple(
    f for f in ExecutionRecord.__dataclass_fields__ if f not in ("execution_id", "extra")
)
"""What an execution record says about its execution (its id and the unknown keys aside)."""


def _require(record: dict, name: str, execution_id: Any, call_id: Any = None) -> Any:
    if name not in record or record[name] is None:
        raise RecordError("missing required field", execution_id=execution_id, call_id=call_id, field=name)
    return record[name]


def _token_array(
    value: Any, name: str, execution_id: Any, call_id: Any, vocab_size: int | None
) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise RecordError(
            f"not a list of token ids ({exc})", execution_id=execution_id, call_id=call_id, field=name
        ) from None
    if arr.ndim != 1:
        raise RecordError(
            "must be a flat list of token ids", execution_id=execution_id, call_id=call_id, field=name
        )
    if arr.size and arr.dtype.kind not in "iu":
        raise RecordError(
            f"token ids must be integers, got {arr.dtype}",
            execution_id=execution_id,
            call_id=call_id,
            field=name,
        )
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        limit = vocab_size if vocab_size is not None else MAX_TOKEN_ID + 1
        if lo < 0:
            at = int(np.argmax(arr < 0))
            raise RecordError(
                f"negative token id {lo} at position {at}",
                execution_id=execution_id,
                call_id=call_id,
                field=name,
            )
        if hi >= limit:
            at = int(np.argmax(arr >= limit))
            raise RecordError(
                f"token id {hi} at position {at} is out of range (vocab_size {limit})",
                execution_id=execution_id,
                call_id=call_id,
                field=name,
            )
    return arr.astype(np.int32, copy=False)


def _optional_float(record: dict, name: str, execution_id: Any, call_id: Any = None) -> float | None:
    value = record.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RecordError(
            f"must be a number, got {value!r}", execution_id=execution_id, call_id=call_id, field=name
        )
    if not math.isfinite(value):
        raise RecordError(
            f"must be finite, got {value!r}", execution_id=execution_id, call_id=call_id, field=name
        )
    return float(value)


def _optional_str(record: dict, name: str, execution_id: Any, call_id: Any = None) -> str | None:
    value = record.get(name)
    if value is not None and not isinstance(value, str):
        raise RecordError(
            f"must be a string, got {value!r}", execution_id=execution_id, call_id=call_id, field=name
        )
    return value


def _check_id(value: Any, name: str, execution_id: Any = None) -> str:
    if not isinstance(value, str) or not value or len(value) > 256 or "/" in value:
        raise RecordError(
            "must be a non-empty string of at most 256 characters without '/'",
            execution_id=execution_id if name != "execution_id" else repr(value),
            field=name,
        )
    return value


def validate_call(record: dict, vocab_size: int | None = None) -> CallRecord:
    """Checks one call (full prompt form) and returns it typed; raises RecordError naming the field."""
    execution_id = _check_id(_require(record, "execution_id", None), "execution_id")
    call_id = record.get("call_id")
    if call_id is not None and (isinstance(call_id, bool) or not isinstance(call_id, int) or call_id < 0):
        raise RecordError(
            "must be a non-negative integer", execution_id=execution_id, call_id=call_id, field="call_id"
        )
    role = _require(record, "role", execution_id, call_id)
    if role not in ROLES:
        raise RecordError(
            f"unknown role {role!r} (expected one of {', '.join(ROLES)})",
            execution_id=execution_id,
            call_id=call_id,
            field="role",
        )
    agent_id = record.get("agent_id") or ("main" if role.startswith("main") else "sub")
    if not isinstance(agent_id, str):
        raise RecordError("must be a string", execution_id=execution_id, call_id=call_id, field="agent_id")
    prompt = _token_array(
        _require(record, "prompt_ids", execution_id, call_id), "prompt_ids", execution_id, call_id, vocab_size
    )
    if prompt.size == 0:
        raise RecordError("prompt is empty", execution_id=execution_id, call_id=call_id, field="prompt_ids")
    output = _token_array(
        _require(record, "output_ids", execution_id, call_id), "output_ids", execution_id, call_id, vocab_size
    )
    logprobs = np.asarray(_require(record, "output_logprobs", execution_id, call_id), dtype=np.float64)
    if logprobs.ndim != 1 or logprobs.size != output.size:
        raise RecordError(
            f"has {logprobs.size} values for {output.size} output tokens",
            execution_id=execution_id,
            call_id=call_id,
            field="output_logprobs",
        )
    if logprobs.size and (not np.all(np.isfinite(logprobs)) or logprobs.max() > 1e-4):
        raise RecordError(
            "logprobs must be finite and <= 0",
            execution_id=execution_id,
            call_id=call_id,
            field="output_logprobs",
        )
    version = _require(record, "policy_version", execution_id, call_id)
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_TOKEN_ID:
        raise RecordError(
            f"must be a non-negative integer, got {version!r}",
            execution_id=execution_id,
            call_id=call_id,
            field="policy_version",
        )
    given_hash = _optional_str(record, "context_hash", execution_id, call_id)
    if given_hash is not None and given_hash != context_hash(prompt):
        raise RecordError(
            "prompt_ids contradict the given context_hash",
            execution_id=execution_id,
            call_id=call_id,
            field="context_hash",
        )
    migrated = record.get("migrated", False)
    if not isinstance(migrated, bool):
        raise RecordError(
            "must be true or false", execution_id=execution_id, call_id=call_id, field="migrated"
        )
    return CallRecord(
        execution_id=execution_id,
        call_id=call_id,
        agent_id=agent_id,
        role=role,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=logprobs.astype(np.float32),
        policy_version=version,
        engine_id=_optional_str(record, "engine_id", execution_id, call_id),
        finish_reason=_optional_str(record, "finish_reason", execution_id, call_id),
        migrated=migrated,
        t_start=_optional_float(record, "t_start", execution_id, call_id),
        t_end=_optional_float(record, "t_end", execution_id, call_id),
        context_hash=given_hash,
    )


def validate_execution(record: dict) -> ExecutionRecord:
    """Checks one execution record and returns it typed; raises RecordError naming the field."""
    execution_id = _check_id(_require(record, "execution_id", None), "execution_id")
    status = _require(record, "status", execution_id)
    if status not in STATUSES:
        raise RecordError(
            f"unknown status {status!r} (expected one of {', '.join(STATUSES)})",
            execution_id=execution_id,
            field="status",
        )
    reward_source = _optional_str(record, "reward_source", execution_id)
    if reward_source is not None and reward_source not in REWARD_SOURCES:
        raise RecordError(
            f"unknown reward_source {reward_source!r} (expected one of {', '.join(REWARD_SOURCES)})",
            execution_id=execution_id,
            field="reward_source",
        )
    n_calls = record.get("n_calls")
    if n_calls is not None and (isinstance(n_calls, bool) or not isinstance(n_calls, int) or n_calls < 0):
        raise RecordError("must be a non-negative integer", execution_id=execution_id, field="n_calls")
    known = {"type", "execution_id", "step", *EXECUTION_RECORD_FIELDS}
    return ExecutionRecord(
        execution_id=execution_id,
        status=status,
        problem_id=_optional_str(record, "problem_id", execution_id),
        group_id=_optional_str(record, "group_id", execution_id),
        harness=_optional_str(record, "harness", execution_id),
        reward=_optional_float(record, "reward", execution_id),
        reward_source=reward_source,
        snapshot_uri=_optional_str(record, "snapshot_uri", execution_id),
        started_at=_optional_float(record, "started_at", execution_id),
        ended_at=_optional_float(record, "ended_at", execution_id),
        n_calls=n_calls,
        extra={k: v for k, v in record.items() if k not in known},
    )


def check_table(table: pa.Table, kind: str, where: str) -> None:
    """Validation on read: a stored file must carry the columns and schema version we understand."""
    expected = SCHEMAS[kind]
    missing = [name for name in expected.names if name not in table.column_names]
    if missing:
        raise RecordError(f"{where}: {kind} file lacks columns {missing}")
    versions = set(table.column("schema_version").to_pylist())
    if versions - {SCHEMA_VERSION}:
        raise RecordError(
            f"{where}: {kind} file has schema_version {sorted(versions)}, this gyrerl reads {SCHEMA_VERSION}"
        )
