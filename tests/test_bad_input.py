"""Bad input is refused loudly and loses nothing valid: each variant of the sample trace below holds
one bad record; importing it must give an error that names the line, execution, call and field,
keep the record under quarantine/ with its reason, and still store every other record exactly (the
later calls of the same execution delta-encode against the calls that did land)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.records import SAMPLE, assert_same_records, read_jsonl
from trajectory_store.interchange import import_jsonl, rebuild_prompt
from trajectory_store.recorder import Recorder
from trajectory_store.schema import RecordError, context_hash
from trajectory_store.storage import Store, StoreConfig

VOCAB_SIZE = 1000  # the sample preset draws token ids from [0, 1000)


# -- the variants --------------------------------------------------------------------------------


def _set(name: str, make: Callable[[dict], object]) -> Callable[[dict], None]:
    return lambda record: record.__setitem__(name, make(record))


def _delete(name: str) -> Callable[[dict], None]:
    return lambda record: record.pop(name)


def _other_prompt_hash(record: dict) -> str:
    prompt = np.asarray(record["prompt_ids"], dtype=np.int32)
    prompt[-1] = (prompt[-1] + 1) % VOCAB_SIZE
    return context_hash(prompt)


def _with_token(name: str, at: int, token: int) -> Callable[[dict], None]:
    def mutate(record: dict) -> None:
        record[name] = [*record[name][:at], token, *record[name][at + 1 :]]

    return mutate


@dataclass(frozen=True)
class Variant:
    name: str
    line: int  # 1-based line of the sample that turns bad
    mutate: Callable[[dict], None] | None  # None: the line is cut in half instead
    field: str | None  # the field the error must name (None: the line does not parse)
    via_cli: bool = False

    def write(self, lines: list[str], path: Path) -> tuple[list[dict], dict]:
        """Writes the variant; returns (the records that stay valid, the bad record's original)."""
        original = json.loads(lines[self.line - 1])
        out = list(lines)
        if self.mutate is None:
            out[self.line - 1] = lines[self.line - 1][: len(lines[self.line - 1]) // 2]
        else:
            bad = json.loads(lines[self.line - 1])
            self.mutate(bad)
            out[self.line - 1] = json.dumps(bad)
        last_line_cut = self.mutate is None and self.line == len(lines)
        path.write_text("\n".join(out) + ("" if last_line_cut else "\n"))
        valid = [json.loads(line) for i, line in enumerate(lines, start=1) if i != self.line]
        return valid, original


VARIANTS = [
    Variant("truncated_call_line", 3, None, None, via_cli=True),
    Variant("truncated_last_line", 59, None, None),
    Variant("missing_role", 3, _delete("role"), "role", via_cli=True),
    Variant("missing_output_logprobs", 9, _delete("output_logprobs"), "output_logprobs"),
    Variant("prompt_contradicts_context_hash", 3, _set("context_hash", _other_prompt_hash), "context_hash"),
    Variant("negative_prompt_token", 17, _with_token("prompt_ids", 5, -3), "prompt_ids"),
    Variant("token_at_vocab_size", 3, _with_token("output_ids", 0, VOCAB_SIZE), "output_ids", via_cli=True),
    Variant("unknown_role", 40, _set("role", lambda r: "boss"), "role"),
    Variant("unknown_execution_status", 15, _set("status", lambda r: "crashed"), "status", via_cli=True),
    Variant(
        "logprobs_length_differs",
        11,
        _set("output_logprobs", lambda r: r["output_logprobs"][:-1]),
        "output_logprobs",
    ),
]


@pytest.fixture(scope="module")
def sample_lines() -> list[str]:
    return SAMPLE.read_text().splitlines()


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_bad_record_is_named_quarantined_and_nothing_valid_is_lost(
    variant, sample_lines, tmp_path, cli_env, capsys
):
    from cli.main import main

    path = tmp_path / f"{variant.name}.jsonl"
    valid, bad = variant.write(sample_lines, path)
    data_root = str(tmp_path / "data")
    config = StoreConfig(data_root=data_root, campaign="bad", vocab_size=VOCAB_SIZE)
    where = [f"{path}:{variant.line}:"]
    if variant.field is not None:
        where += [f"execution {bad['execution_id']!r}", f"field {variant.field!r}"]
        if bad["type"] == "call":
            where.append(f"call {bad['call_id']}")

    if variant.via_cli:
        store_args = ["--data-root", data_root, "--campaign", "bad", "--vocab-size", str(VOCAB_SIZE)]
        assert main(["traj", "import", str(path), *store_args]) == 1
        captured = capsys.readouterr()
        errors = [line for line in captured.err.splitlines() if line.startswith("gyre: error: ")]
        assert len(errors) == 1, captured.err
        assert "Traceback" not in captured.err
    else:
        report = import_jsonl(Store(config), str(path))
        assert report.quarantined == 1
        errors = report.errors
        assert len(errors) == 1
    for part in where:
        assert part in errors[0], (part, errors[0])

    store = Store(config)
    [entry] = store.quarantined()
    assert entry["line"] == variant.line and entry["source"] == str(path)
    assert entry["reason"]
    if variant.field is None:
        assert "JSON" in entry["reason"] and "raw" in entry["record"]
    else:
        assert entry["field"] == variant.field
        assert entry["execution_id"] == bad["execution_id"]
        assert entry["call_id"] == bad.get("call_id")
        assert entry["record"]["execution_id"] == bad["execution_id"]

    n_calls = sum(r["type"] == "call" for r in valid)
    n_executions = sum(r["type"] == "execution" for r in valid)
    assert store.read_table("calls").num_rows == n_calls
    assert store.read_table("executions").num_rows == n_executions
    out = tmp_path / "export.jsonl"
    assert main(["traj", "export", out.as_posix(), "--data-root", data_root, "--campaign", "bad"]) == 0
    assert_same_records(valid, read_jsonl(out))


def test_token_at_vocab_size_is_accepted_without_a_vocab_size(sample_lines, tmp_path):
    """The same token id is valid when no vocab_size is configured: the limit is the configured one."""
    variant = next(v for v in VARIANTS if v.name == "token_at_vocab_size")
    path = tmp_path / "trace.jsonl"
    variant.write(sample_lines, path)

    report = import_jsonl(Store(StoreConfig(data_root=str(tmp_path / "data"))), str(path))

    assert report.quarantined == 0 and report.calls == 55


def test_a_huge_garbage_line_is_quarantined_as_its_head_and_size(sample_lines, tmp_path):
    """A line that does not parse keeps its first 4 KiB, its size and its hash, never all of it."""
    from trajectory_store.interchange import RAW_HEAD_BYTES

    garbage = ("no json here: " + "x" * 97 + "\u00e9") * 30_000  # ~3.4 MB, the last char two bytes in UTF-8
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join([*sample_lines[:2], garbage, *sample_lines[2:]]) + "\n")
    config = StoreConfig(data_root=str(tmp_path / "data"), campaign="big")
    line = (garbage + "\n").encode()

    report = import_jsonl(Store(config), str(path))

    assert report.quarantined == 1 and report.calls == 55 and report.executions == 4
    assert f"{path}:3: not valid JSON" in report.errors[0]
    store = Store(config)
    [entry] = store.quarantined()
    record = entry["record"]
    assert entry["line"] == 3
    assert record["raw_bytes"] == len(line) > 3_000_000
    assert record["raw_truncated"] is True
    assert record["raw"] == line[:RAW_HEAD_BYTES].decode(errors="replace")
    assert record["raw_sha256"] == hashlib.sha256(line).hexdigest()
    quarantine_bytes = sum(f.stat().st_size for f in Path(store.path("quarantine")).rglob("*") if f.is_file())
    assert quarantine_bytes < 3 * RAW_HEAD_BYTES
    assert store.read_table("calls").num_rows == 55


# -- the recorder API ------------------------------------------------------------------------------


def _call(rng: np.random.Generator, prompt: np.ndarray) -> dict:
    output = rng.integers(0, VOCAB_SIZE, 7, dtype=np.int32)
    return {
        "prompt_ids": prompt,
        "output_ids": output,
        "output_logprobs": -rng.random(7, dtype=np.float32),
        "policy_version": 0,
    }


def test_recorder_raises_record_error_and_still_flushes_the_good_calls(store_config):
    store = Store(store_config)
    recorder = Recorder(store, step=0)
    rng = np.random.default_rng(0)
    first = _call(rng, rng.integers(0, VOCAB_SIZE, 20, dtype=np.int32))
    bad = _call(rng, np.concatenate([first["prompt_ids"], first["output_ids"], [5, 6]]))
    second = _call(rng, np.concatenate([first["prompt_ids"], first["output_ids"], [7, 8]]))

    recorder.record_call("e1", "main", "main", call_id=0, **first)
    with pytest.raises(RecordError, match="unknown role 'boss'") as raised:
        recorder.record_call("e1", "main", "boss", call_id=1, **bad)
    recorder.record_call("e1", "main", "main", call_id=1, **second)
    report = recorder.close()

    assert (raised.value.execution_id, raised.value.call_id, raised.value.field) == ("e1", 1, "role")
    assert "execution 'e1', call 1, field 'role'" in str(raised.value)
    assert report.calls == 2 and report.quarantined == 1
    [entry] = store.quarantined()
    assert entry["field"] == "role" and "boss" in entry["reason"] and entry["record"]["role"] == "boss"
    for call_id, call in enumerate([first, second]):
        np.testing.assert_array_equal(rebuild_prompt(store, "e1", call_id), call["prompt_ids"])


# -- stored files of another schema version ---------------------------------------------------------


@pytest.fixture
def store_with_future_part(store_config) -> tuple[Store, str]:
    """The sample, plus a hand-written calls part (committed by a manifest) of schema_version 2."""
    store = Store(store_config)
    assert import_jsonl(store, str(SAMPLE)).quarantined == 0
    calls = store.read_table("calls")
    calls = calls.filter(pc.equal(calls["execution_id"], "p0-e0"))
    calls = calls.set_column(
        calls.schema.get_field_index("execution_id"), "execution_id", pa.array(["future-e0"] * len(calls))
    )
    calls = calls.set_column(
        calls.schema.get_field_index("schema_version"),
        "schema_version",
        pa.array([2] * len(calls), pa.int16()),
    )
    rel = "calls/step=1/part-future.parquet"
    Path(store.path(rel)).parent.mkdir(parents=True)
    pq.write_table(calls, store.path(rel))
    store.commit(1, {"calls": [rel]}, {"calls": len(calls)})
    return store, store.path(rel)


def test_wrong_schema_version_names_the_file_when_read(store_with_future_part, cli_env, capsys, tmp_path):
    from cli.main import main

    store, path = store_with_future_part

    with pytest.raises(RecordError, match="schema_version") as raised:
        store.read_table("calls")
    assert path in str(raised.value)

    config = store.config
    store_args = ["--data-root", config.data_root, "--campaign", config.campaign]
    assert main(["traj", "export", str(tmp_path / "out.jsonl"), *store_args]) == 2
    err = capsys.readouterr().err
    assert "part-future.parquet" in err and "schema_version" in err and "Traceback" not in err


def test_wrong_schema_version_is_refused_by_sql_too(store_with_future_part):
    """DuckDB reads the same parts: a file of an unknown schema version must not be read silently."""
    from trajectory_store.db import connect

    store, path = store_with_future_part

    with pytest.raises(Exception, match="schema_version") as raised:
        connect(store).sql("SELECT count(*) FROM calls").fetchall()
    assert Path(path).name in str(raised.value)
