"""The storage benchmark: bytes per unique token, import speed, and the cost of trees and selection.

    gyre bench store            # full preset: 8 executions, contexts up to 128K, ~100M naive tokens
    gyre bench store --quick    # quick preset: a few seconds
    python -m bench.store [--quick] [--out bench/results/store.json]

Everything is measured in ONE run against a baseline of the same run, because the machine is
shared and noisy: read the ratios, not the absolute seconds.

1. Workload: ``trajectory_store.synth`` paper-shaped executions (context compression, sub-agents,
   retries), generated one execution at a time and streamed into the recorder, never as JSONL.
2. Our layout: every call goes through ``Recorder.record_call`` (validation, prefix index, hashes,
   Parquet parts and manifests). ``import_tokens_per_s`` = naive tokens (prompt + output of every
   call) / seconds inside the recorder calls and ``close()``; the generator's time is excluded.
3. Bytes: the stored calls read back as Arrow (``stored_bytes``, before compression) and the
   committed Parquet parts (``parquet_bytes``), both over 4 bytes per unique token, with the
   breakdown into token ids, behaviour logprobs and the other columns.
4. Baseline: the same calls in the naive layout (full prompt_ids + output_ids + output_logprobs per
   call, the same metadata columns) built from numpy buffers and written as Parquet (zstd) in chunks
   of one execution. Its write time includes the table build but no validation or hashing (the
   context hashes come from the recorder), so the baseline's speed is, if anything, flattered.
5. Trees and selection: the DuckDB views (tree_nodes, trajectories, selected_trajectories,
   training_tokens) queried fresh (views are not materialized), and ``processor.pack``.
6. Snapshots (bench/store_snapshots.py): a group of G timed-out executions of one problem stored as
   Parquet rows + content-addressed blobs against the tar.gz of each workspace
   (``snapshot_bytes_over_targz``, ``snapshot_dedup_ratio``, write and read-back times).

Prints one figure per line and writes JSON (indent 1) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.store_snapshots import run_snapshots
from bench.store_snapshots import summary_lines as snapshot_lines
from trajectory_store import db, synth
from trajectory_store.config import PackingConfig
from trajectory_store.processor import pack
from trajectory_store.recorder import RecordedCall, Recorder
from trajectory_store.schema import CALLS_SCHEMA, SCHEMA_VERSION
from trajectory_store.storage import Store, StoreConfig

DEFAULT_OUT = "bench/results/store.json"
STORED_OVER_UNIQUE_GOAL = 1.2  # the goal for stored bytes / (4 bytes x unique tokens)
PACK_BUDGET = {"full": 140_000}  # token budget of a packed sequence; other presets use the default
PACK_BUDGET_DEFAULT = 20_000
WEIGHT_TOLERANCE = 1e-6

# The baseline keeps every metadata column of the calls dataset and replaces the delta encoding
# (parent_call_id, prefix_len, new_ids, prompt_len, output_len) with the full token lists.
_KEY_COLUMNS = ("execution_id", "call_id", "step", "agent_id", "role")
_DELTA_COLUMNS = ("parent_call_id", "prefix_len", "new_ids", "prompt_len", "output_len")
NAIVE_SCHEMA = pa.schema(
    [
        *[CALLS_SCHEMA.field(name) for name in _KEY_COLUMNS],
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("output_ids", pa.list_(pa.int32()), nullable=False),
        *[f for f in CALLS_SCHEMA if f.name not in _KEY_COLUMNS + _DELTA_COLUMNS],
    ]
)

TREE_QUERIES = {
    "tree_nodes": "SELECT count(*), sum(n_tokens), sum(n_tokens) FILTER (WHERE is_policy) FROM tree_nodes",
    "trajectories": "SELECT count(*) FROM trajectories",
    "selected_trajectories": "SELECT count(*) FROM selected_trajectories",
    "training_tokens": "SELECT count(*), sum(weight) FROM training_tokens",
}


def _list_array(arrays: list[np.ndarray], dtype: type, value_type: pa.DataType) -> pa.ListArray:
    """One Arrow list column from per-row numpy arrays, through a single concatenated buffer."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    total = int(lengths.sum())
    if total >= 2**31:
        raise ValueError(f"{total} values do not fit int32 list offsets; write smaller chunks")
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(lengths)
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def naive_table(calls: list[dict[str, Any]], recorded: list[RecordedCall], step: int) -> pa.Table:
    """The naive layout of one execution's calls: full prompt and output ids on every row."""
    columns: dict[str, Any] = {
        "execution_id": [c["execution_id"] for c in calls],
        "call_id": [r.call_id for r in recorded],
        "step": [step] * len(calls),
        "agent_id": [c["agent_id"] for c in calls],
        "role": [c["role"] for c in calls],
        "prompt_ids": _list_array([c["prompt_ids"] for c in calls], np.int32, pa.int32()),
        "output_ids": _list_array([c["output_ids"] for c in calls], np.int32, pa.int32()),
        "output_logprobs": _list_array([c["output_logprobs"] for c in calls], np.float32, pa.float32()),
        "policy_version": [c["policy_version"] for c in calls],
        "engine_id": [c.get("engine_id") for c in calls],
        "context_hash": [r.context_hash for r in recorded],
        "finish_reason": [c.get("finish_reason") for c in calls],
        "migrated": [bool(c.get("migrated", False)) for c in calls],
        "t_start": [c.get("t_start") for c in calls],
        "t_end": [c.get("t_end") for c in calls],
        "schema_version": [SCHEMA_VERSION] * len(calls),
    }
    return pa.Table.from_pydict(columns, schema=NAIVE_SCHEMA)


class NaiveLayoutWriter:
    """Writes the baseline as one Parquet file, one row group (or more) per execution."""

    def __init__(self, path: str, compression: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._writer = pq.ParquetWriter(self._file, NAIVE_SCHEMA, compression=compression)
        self.arrow_bytes = 0
        self.seconds = 0.0  # table builds and writes, fsync included

    def write(self, calls: list[dict[str, Any]], recorded: list[RecordedCall], step: int) -> None:
        started = time.perf_counter()
        table = naive_table(calls, recorded, step)
        self._writer.write_table(table)
        self.seconds += time.perf_counter() - started
        self.arrow_bytes += table.nbytes

    def close(self) -> int:
        """Finishes the file (on disk, like the store's parts); returns its size in bytes."""
        started = time.perf_counter()
        self._writer.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.seconds += time.perf_counter() - started
        return os.path.getsize(self.path)


def per_execution(records: Iterator[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Groups synth's stream (an execution record, then its calls) into one item per execution."""
    execution: dict[str, Any] | None = None
    calls: list[dict[str, Any]] = []
    for record in records:
        if record["type"] == "execution":
            if execution is not None:
                yield execution, calls
            execution, calls = record, []
        else:
            calls.append(record)
    if execution is not None:
        yield execution, calls


def record_execution(
    recorder: Recorder, execution: dict[str, Any], calls: list[dict[str, Any]]
) -> list[RecordedCall]:
    """Streams one execution through the recorder API, as the gateway would."""
    fields = {k: v for k, v in execution.items() if k not in ("type", "execution_id", "status")}
    recorder.record_execution(execution["execution_id"], execution["status"], **fields)
    recorded = [
        recorder.record_call(
            c["execution_id"],
            c["agent_id"],
            c["role"],
            c["prompt_ids"],
            c["output_ids"],
            c["output_logprobs"],
            c["policy_version"],
            call_id=c.get("call_id"),
            engine_id=c.get("engine_id"),
            finish_reason=c.get("finish_reason"),
            migrated=c.get("migrated", False),
            t_start=c.get("t_start"),
            t_end=c.get("t_end"),
        )
        for c in calls
    ]
    recorder.forget(execution["execution_id"])  # its last call is in: release the prefix index
    return recorded


def _timed(con: duckdb.DuckDBPyConnection, sql: str) -> tuple[tuple, float]:
    started = time.perf_counter()
    row = con.sql(sql).fetchall()[0]
    return row, time.perf_counter() - started


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def run(preset_name: str, workdir: str) -> dict[str, Any]:
    """Runs the whole benchmark in ``workdir`` (a scratch folder) and returns its figures."""
    wall_started = time.perf_counter()
    cfg = synth.preset(preset_name)
    store = Store(StoreConfig(data_root=workdir, campaign="bench"))
    recorder = Recorder(store, step=0)
    naive = NaiveLayoutWriter(store.path("naive_layout", "part-0.parquet"), store.config.compression)
    n_executions = n_calls = naive_tokens = unique_tokens = output_tokens = max_prompt = 0
    generate_s = import_s = 0.0

    stream = per_execution(synth.generate(cfg))
    while True:
        started = time.perf_counter()
        item = next(stream, None)  # the generator runs here, outside the timed recorder calls
        generate_s += time.perf_counter() - started
        if item is None:
            break
        execution, calls = item
        started = time.perf_counter()
        recorded = record_execution(recorder, execution, calls)
        import_s += time.perf_counter() - started
        naive.write(calls, recorded, step=0)
        n_executions += 1
        n_calls += len(calls)
        for call in calls:
            naive_tokens += len(call["prompt_ids"]) + len(call["output_ids"])
            output_tokens += len(call["output_ids"])
            max_prompt = max(max_prompt, len(call["prompt_ids"]))
        unique_tokens += sum(r.n_new_tokens for r in recorded)
        del execution, calls, recorded, item
    started = time.perf_counter()
    recorder.close()
    import_s += time.perf_counter() - started
    naive_parquet_bytes = naive.close()

    # -- bytes of our layout, read back ------------------------------------------------------
    started = time.perf_counter()
    table = store.read_table("calls")
    read_back_s = time.perf_counter() - started
    parts = store.visible_parts("calls")
    parquet_bytes = sum(store.fs.size(p) for p in parts)
    stored_bytes = table.nbytes
    token_bytes = table.column("new_ids").nbytes
    logprob_bytes = table.column("output_logprobs").nbytes
    stored_unique = int(pc.sum(pc.list_value_length(table.column("new_ids"))).as_py() or 0)
    stored_rows = table.num_rows
    del table
    unique_int32 = 4 * unique_tokens

    # -- trees and selection in DuckDB -------------------------------------------------------
    con = db.connect(store)
    query_s: dict[str, float] = {}
    results: dict[str, tuple] = {}
    for name, sql in TREE_QUERIES.items():
        results[name], query_s[name] = _timed(con, sql)
    tree_s = sum(query_s.values())
    n_nodes, tree_tokens, policy_tokens = (int(v or 0) for v in results["tree_nodes"])
    weight_sums = con.sql("SELECT execution_id, sum(weight) FROM training_tokens GROUP BY ALL").fetchall()
    weights_ok = bool(weight_sums) and all(abs(s - 1.0) < WEIGHT_TOLERANCE for _, s in weight_sums)
    longest = int(con.sql("SELECT coalesce(max(n_tokens), 0) FROM selected_trajectories").fetchall()[0][0])
    budget = max(PACK_BUDGET.get(preset_name, PACK_BUDGET_DEFAULT), longest + 1)
    started = time.perf_counter()
    batch = pack(con, PackingConfig(token_budget=budget))
    pack_s = time.perf_counter() - started
    con.close()

    figures: dict[str, Any] = {
        "preset": preset_name,
        "executions": n_executions,
        "calls": n_calls,
        "naive_tokens": naive_tokens,
        "unique_tokens": unique_tokens,
        "policy_tokens": policy_tokens,
        "output_tokens": output_tokens,
        "max_prompt_tokens": max_prompt,
        "naive_over_unique_tokens": _ratio(naive_tokens, unique_tokens),
        "policy_token_fraction": _ratio(policy_tokens, unique_tokens),
        # our layout
        "import_s": import_s,
        "import_tokens_per_s": _ratio(naive_tokens, import_s),
        "import_unique_tokens_per_s": _ratio(unique_tokens, import_s),
        "generate_s": generate_s,
        "calls_parts": len(parts),
        "stored_bytes": stored_bytes,
        "parquet_bytes": parquet_bytes,
        "stored_over_unique_int32": _ratio(stored_bytes, unique_int32),
        "stored_over_unique_int32_compressed": _ratio(parquet_bytes, unique_int32),
        "token_bytes_over_unique_int32": _ratio(token_bytes, unique_int32),
        "logprob_bytes_over_unique_int32": _ratio(logprob_bytes, unique_int32),
        "other_bytes_over_unique_int32": _ratio(stored_bytes - token_bytes - logprob_bytes, unique_int32),
        "read_back_s": read_back_s,
        # the naive layout, same run
        "naive_layout_bytes": naive.arrow_bytes,
        "naive_layout_parquet_bytes": naive_parquet_bytes,
        "naive_layout_bytes_ratio": _ratio(naive.arrow_bytes, stored_bytes),
        "naive_layout_parquet_ratio": _ratio(naive_parquet_bytes, parquet_bytes),
        "naive_layout_write_s": naive.seconds,
        "naive_layout_write_tokens_per_s": _ratio(naive_tokens, naive.seconds),
        # trees, selection, packing
        "tree_nodes": n_nodes,
        "tree_tokens": tree_tokens,
        "trajectories": int(results["trajectories"][0]),
        "selected_trajectories": int(results["selected_trajectories"][0]),
        "training_tokens": int(results["training_tokens"][0]),
        "training_weight_sum": float(results["training_tokens"][1] or 0.0),
        "trained_executions": len(weight_sums),
        "weights_sum_to_one": weights_ok,
        "query_s": query_s,
        "tree_and_selection_s": tree_s,
        "tree_and_selection_s_per_execution": _ratio(tree_s, n_executions),
        "pack_token_budget": budget,
        "pack_s": pack_s,
        "pack_sequences": len(batch.sequences),
        "pack_tokens": batch.n_tokens,
        "pack_target_tokens": batch.n_target_tokens,
        "repeated_tokens": batch.n_repeated_tokens,
    }
    figures.update(run_snapshots(preset_name, workdir))
    figures["consistency"] = {
        "snapshot export == tar.gz of the workspace": figures["snapshot_export_equals_targz"],
        "stored_rows == calls": stored_rows == n_calls,
        "stored new_ids == unique_tokens": stored_unique == unique_tokens,
        "tree_nodes tokens == unique_tokens": tree_tokens == unique_tokens,
    }
    figures["goals"] = {
        f"stored_over_unique_int32 <= {STORED_OVER_UNIQUE_GOAL}": figures["stored_over_unique_int32"]
        <= STORED_OVER_UNIQUE_GOAL,
        "naive_layout_bytes_ratio > 1": figures["naive_layout_bytes_ratio"] > 1,
        "naive_layout_parquet_ratio > 1": figures["naive_layout_parquet_ratio"] > 1,
        "weights_sum_to_one": weights_ok,
        "snapshot_dedup_ratio > 1": figures["snapshot_dedup_ratio"] > 1,
    }
    figures["environment"] = {
        "python": platform.python_version(),
        "duckdb": duckdb.__version__,
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    figures["wall_s"] = time.perf_counter() - wall_started
    return figures


def summary_lines(f: dict[str, Any]) -> list[str]:
    """The human-readable report: one figure per line, with units."""
    q = f["query_s"]
    rows = [
        ("workload", f"{f['preset']} preset: {f['executions']} executions, {f['calls']} calls"),
        ("naive tokens (prompt + output of every call)", f"{f['naive_tokens']:,} tokens"),
        ("unique tokens (stored new_ids)", f"{f['unique_tokens']:,} tokens"),
        ("policy tokens", f"{f['policy_tokens']:,} tokens ({f['policy_token_fraction']:.1%} of unique)"),
        ("longest prompt", f"{f['max_prompt_tokens']:,} tokens"),
        ("naive / unique tokens", f"{f['naive_over_unique_tokens']:.1f} x"),
        (
            "import (recorder)",
            f"{f['import_tokens_per_s'] / 1e6:.2f} M naive tokens/s ({f['import_s']:.2f} s)",
        ),
        ("stored (Arrow) / 4 B per unique token", f"{f['stored_over_unique_int32']:.3f} x"),
        ("  token ids (values + offsets)", f"{f['token_bytes_over_unique_int32']:.3f} x"),
        ("  behaviour logprobs", f"{f['logprob_bytes_over_unique_int32']:.3f} x"),
        ("  other columns", f"{f['other_bytes_over_unique_int32']:.3f} x"),
        ("stored (Parquet zstd) / 4 B per unique token", f"{f['stored_over_unique_int32_compressed']:.3f} x"),
        (
            "stored bytes (Arrow / Parquet)",
            f"{f['stored_bytes'] / 2**20:.1f} MiB / {f['parquet_bytes'] / 2**20:.1f} MiB",
        ),
        (
            "naive layout bytes (Arrow / Parquet)",
            f"{f['naive_layout_bytes'] / 2**20:.1f} MiB / {f['naive_layout_parquet_bytes'] / 2**20:.1f} MiB",
        ),
        ("naive layout / ours (Arrow)", f"{f['naive_layout_bytes_ratio']:.1f} x"),
        ("naive layout / ours (Parquet)", f"{f['naive_layout_parquet_ratio']:.1f} x"),
        (
            "naive layout write",
            f"{f['naive_layout_write_tokens_per_s'] / 1e6:.2f} M naive tokens/s "
            f"({f['naive_layout_write_s']:.2f} s)",
        ),
        ("tree_nodes query", f"{q['tree_nodes']:.3f} s ({f['tree_nodes']:,} nodes)"),
        ("trajectories query", f"{q['trajectories']:.3f} s ({f['trajectories']:,} trajectories)"),
        (
            "selected_trajectories query",
            f"{q['selected_trajectories']:.3f} s ({f['selected_trajectories']:,} selected)",
        ),
        ("training_tokens query", f"{q['training_tokens']:.3f} s ({f['training_tokens']:,} tokens)"),
        (
            "trees + selection",
            f"{f['tree_and_selection_s']:.3f} s "
            f"({f['tree_and_selection_s_per_execution']:.3f} s per execution)",
        ),
        ("weights sum to 1 per execution", "yes" if f["weights_sum_to_one"] else "NO"),
        (
            "pack",
            f"{f['pack_s']:.3f} s: {f['pack_sequences']} sequences of <= {f['pack_token_budget']:,} tokens, "
            f"{f['repeated_tokens']:,} repeated tokens",
        ),
        *snapshot_lines(f),
        ("peak memory (RSS)", f"{f['peak_rss_mb']:.0f} MiB"),
        ("wall time", f"{f['wall_s']:.1f} s"),
    ]
    lines = [f"{name:<46} {value}" for name, value in rows]
    lines += [f"goal {goal:<41} {'met' if met else 'NOT met'}" for goal, met in f["goals"].items()]
    lines += [f"check {name:<40} {'ok' if ok else 'FAILED'}" for name, ok in f["consistency"].items()]
    return lines


def main(quick: bool = False, out: str = DEFAULT_OUT, *, preset: str | None = None) -> int:
    """Runs the benchmark, prints the summary, writes JSON to ``out``; returns the exit code."""
    preset_name = preset or ("quick" if quick else "full")
    with tempfile.TemporaryDirectory(prefix="gyre-bench-store-") as workdir:
        figures = run(preset_name, workdir)
    print("\n".join(summary_lines(figures)))
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(figures, indent=1) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick preset (a few seconds)")
    parser.add_argument("--preset", choices=sorted(synth.PRESETS), default=None, help="override the preset")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    sys.exit(main(quick=args.quick, out=args.out, preset=args.preset))
