"""Storage: idempotent, atomic writes made visible by a manifest written last."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from tests.trees import random_execution
from trajectory_store.db import connect
from trajectory_store.recorder import Recorder
from trajectory_store.schema import RecordError
from trajectory_store.storage import Store


def files_under(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def write(store: Store, calls: list[dict], flush_calls: int = 1000, status: str = "completed") -> None:
    recorder = Recorder(store, step=3, flush_calls=flush_calls)
    for call in calls:
        recorder.record_call_dict(call)
    recorder.record_execution(calls[0]["execution_id"], status, reward=1.0)
    recorder.close()


def counts(store: Store) -> tuple[int, int, int]:
    con = connect(store)
    return (
        con.execute("SELECT count(*) FROM calls").fetchall()[0][0],
        con.execute("SELECT count(*) FROM executions").fetchall()[0][0],
        con.execute("SELECT coalesce(sum(n_tokens), 0) FROM tree_nodes").fetchall()[0][0],
    )


def test_writing_the_same_step_twice_leaves_one_copy(store_config):
    store = Store(store_config)
    calls = random_execution(seed=1, n_calls=12, vocab=5)
    write(store, calls)
    first_files, first_counts = files_under(store.campaign_dir), counts(store)
    write(store, calls)  # a retried task writes the same objects again
    assert files_under(store.campaign_dir) == first_files
    assert counts(store) == first_counts
    assert first_counts[0] == 12 and first_counts[1] == 1


def test_rows_written_twice_in_other_batches_are_seen_once(store_config):
    store = Store(store_config)
    calls = random_execution(seed=2, n_calls=12, vocab=5)
    write(store, calls, flush_calls=1000)
    expected = counts(store)
    write(store, calls, flush_calls=5)  # other flush boundaries: other part keys
    assert len(store.visible_parts("calls")) > 1
    assert counts(store) == expected


def test_parts_without_a_manifest_are_invisible(store_config):
    store = Store(store_config)
    calls = random_execution(seed=3, n_calls=6, vocab=7)
    # a crash after the part was written and before the manifest: nothing is visible
    recorder = Recorder(store, step=0)
    for call in calls:
        recorder.record_call_dict(call)
    store.commit = lambda *a, **k: (_ for _ in ()).throw(OSError("crash before the manifest"))  # type: ignore[method-assign]
    with pytest.raises(OSError, match="crash"):
        recorder.flush()
    assert any(path.endswith(".parquet") for path in files_under(store.campaign_dir))
    fresh = Store(store.config)
    assert fresh.visible_parts("calls") == []
    assert counts(fresh) == (0, 0, 0)
    # a temporary file left by a crash mid-write is not a manifest either
    os.makedirs(fresh.path("manifests/step=0"), exist_ok=True)
    with open(fresh.path("manifests/step=0/abc.json.tmp-123"), "w") as handle:
        handle.write('{"partial')
    assert fresh.manifests() == []


def test_a_call_recorded_twice_is_a_no_op_and_a_conflicting_one_an_error(store_config):
    store = Store(store_config)
    recorder = Recorder(store, step=0)
    call = random_execution(seed=4, n_calls=1, vocab=9)[0]
    first = recorder.record_call_dict(call)
    assert first.call_id == 0
    recorder.record_call_dict(call)  # same call id, same tokens
    conflicting = {**call, "output_ids": np.array([1, 2], np.int32), "output_logprobs": [-0.1, -0.2]}
    with pytest.raises(RecordError, match="already recorded with different tokens"):
        recorder.record_call_dict(conflicting)
    out_of_order = {**call, "call_id": 0, "prompt_ids": [5, 5, 5]}
    with pytest.raises(RecordError, match="call 0"):
        recorder.record_call_dict(out_of_order)
    recorder.close()
    assert counts(store)[0] == 1
    assert len(store.quarantined()) == 2  # both bad records are kept, with their reasons


def test_delta_encoding_stores_unique_tokens_only(store_config):
    store = Store(store_config)
    recorder = Recorder(store, step=0)
    context = list(range(100))
    naive = 0
    for turn in range(20):  # a multi-turn conversation: each prompt repeats everything before it
        output = [1000 + turn, 2000 + turn]
        recorder.record_call("e", "main", "main", context, output, [-0.5, -0.5], policy_version=turn)
        naive += len(context) + len(output)
        context = [*context, *output, 3000 + turn]
    recorder.close()
    calls = store.read_table("calls")
    stored = sum(len(ids) for ids in calls.column("new_ids").to_pylist())
    assert stored == 100 + 20 * 2 + 19  # the system prompt once, then only what each turn added
    assert naive > 10 * stored
    assert calls.column("parent_call_id").to_pylist() == [None, *range(19)]


def test_metrics_dataset_round_trips(store_config):
    from trajectory_store.schema import METRICS_SCHEMA, SCHEMA_VERSION

    store = Store(store_config)
    table = pa.Table.from_pylist(
        [{"step": 0, "name": "step_time_s", "value": 1.5, "cell_id": "c0", "schema_version": SCHEMA_VERSION}],
        schema=METRICS_SCHEMA,
    )
    part = store.write_part("metrics", 0, table, key="m0")
    store.commit(0, {"metrics": [part]}, {"metrics": 1})
    assert connect(store).execute("SELECT name, value FROM metrics").fetchall() == [("step_time_s", 1.5)]
