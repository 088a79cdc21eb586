"""JSONL records of the sample trace, and the exact-round-trip comparison the tests share."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample_trace.jsonl"


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def record_key(record: dict) -> tuple:
    return record["type"], record["execution_id"], record.get("call_id", -1)


def assert_same_records(original: list[dict], exported: list[dict]) -> None:
    """Every field of every original record comes back: ints exactly, logprobs as float32."""
    assert sorted(map(record_key, exported)) == sorted(map(record_key, original))
    by_key = {record_key(r): r for r in exported}
    for want in original:
        got = by_key[record_key(want)]
        for name, value in want.items():
            if name == "output_logprobs":
                np.testing.assert_array_equal(
                    np.asarray(got[name], dtype=np.float32), np.asarray(value, dtype=np.float32), err_msg=name
                )
            else:
                assert got[name] == value, (record_key(want), name)
