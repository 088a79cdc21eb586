"""The stages of one xLong size (bench/xlong.py), each run in a process of its own.

`run_stage` starts ``python -m bench.xlong --stage NAME`` (that module's command line hands it to
`_stage_main`), so each stage's peak resident memory is its own: `stage_rollout` (the group through
the real stack, driven by bench/xlong_workload.py's harness; the engine's and the gateway's memory
from /proc VmHWM), `stage_tree` (the DuckDB views, with DuckDB's memory limit and a spill folder),
`stage_pack`, `stage_train` (the trainer's GradWorker), and `stage_snapshot` (a workspace stored as
snapshot rows and blobs, then written back); `stage_piecewise` trains the same trees in one piece
and in pieces. Each returns its figures, which bench/xlong.py gathers per size.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from bench.xlong_workload import WORDS, policy_copy, run_group
from engines.admin import AdminClient
from stack.stack import local_stack
from trajectory_store import db
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.storage import Store, StoreConfig

ENGINE_THREADS = 2
DUCKDB_MEMORY_LIMIT = "1GB"
PIECE_BUDGET = 16_384
SELECT_ALL = 1_000_000  # j_max: every trajectory of the execution is trained
SNAPSHOT_FILE_BYTES = 256 << 10


def _hwm_gb(pid: int) -> float:
    """A live process's peak resident memory (/proc VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no VmHWM for process {pid}")


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def stage_rollout(work: str, goal: int, seed: int) -> dict[str, Any]:
    from engines.model.loading import load_tokenizer

    policy = policy_copy(os.path.join(work, "policy"))
    store = StoreConfig(data_root=os.path.join(work, "store"), campaign="xlong")
    tokenizer = load_tokenizer(policy)
    started = time.perf_counter()
    with local_stack(policy, store, threads=ENGINE_THREADS, dtype="float32") as stack:
        stack_s = time.perf_counter() - started
        started = time.perf_counter()
        logs = asyncio.run(run_group(stack.gateway_url, stack.admin_token, goal, tokenizer, seed))
        harness_s = time.perf_counter() - started
        with AdminClient(stack.gateway_url, stack.admin_token) as admin:
            admin.flush()
            gateway = admin.gateway_stats()
        engine_url = stack.engine_urls[0]
        with AdminClient(engine_token=stack.engine_admin_token) as admin:
            engine = admin.engine_stats(engine_url)
        engine_gb = _hwm_gb(stack.processes[engine_url].pid)
        gateway_gb = _hwm_gb(stack.processes[stack.gateway_url].pid)
    xlong = logs["xlong"]
    touched = sum(log.touched for log in logs.values())
    return {
        "stack_start_s": stack_s,
        "s": harness_s,
        "calls": xlong.calls,
        "tokens_touched": xlong.touched,
        "group_tokens_touched": touched,
        "prompt_tokens": xlong.prompt_tokens,
        "completion_tokens": xlong.completion_tokens,
        "max_context_tokens": xlong.max_prompt_tokens,
        "roles": dict(xlong.roles),
        "agents": len(xlong.agents),
        "branches": xlong.branches,
        "summaries": xlong.summaries,
        "tokens_per_s": touched / harness_s,
        "engine_prefilled_tokens": engine.prefilled_tokens,
        "engine_cached_tokens": engine.cached_tokens,
        "engine_recomputed_tokens": engine.recomputed_tokens,
        "engine_decoded_tokens": engine.decoded_tokens,
        "engine_peak_rss_gb": engine_gb,
        "gateway_peak_rss_gb": gateway_gb,
        "gateway_reused_prompt_tokens": gateway.reused_prompt_tokens,
        "gateway_tokenized_prompt_tokens": gateway.tokenized_prompt_tokens,
        "harness_peak_rss_gb": _rss_gb(),
    }


def _connect(work: str, selection: SelectionConfig | None = None):
    """The store's views with DuckDB's memory limit and spill folder set (StoreConfig), selecting every
    trajectory by default: the training tree is then the whole execution."""
    store = StoreConfig(
        data_root=os.path.join(work, "store"),
        campaign="xlong",
        duckdb_memory_limit=DUCKDB_MEMORY_LIMIT,
        duckdb_temp_directory=os.path.join(work, "duckdb-spill"),
    )
    return db.connect(Store(store), selection or SelectionConfig(j_max=SELECT_ALL))


TREE_QUERIES = {
    "tree_nodes": "SELECT count(*), sum(n_tokens), sum(n_tokens) FILTER (WHERE is_policy) FROM tree_nodes",
    "trajectories": "SELECT count(*) FROM trajectories",
    "selected_trajectories": "SELECT count(*), max(n_tokens) FROM selected_trajectories",
    "training_tokens": "SELECT count(*), sum(weight) FROM training_tokens",
}


def stage_tree(work: str) -> dict[str, Any]:
    con = _connect(work)
    started = time.perf_counter()
    results = {name: con.execute(sql).fetchall()[0] for name, sql in TREE_QUERIES.items()}
    seconds = time.perf_counter() - started
    con.close()
    con = _connect(work, SelectionConfig())  # what a campaign's default selection would train
    default = con.execute(TREE_QUERIES["selected_trajectories"]).fetchall()[0]
    default_tokens = con.execute(TREE_QUERIES["training_tokens"]).fetchall()[0][0]
    con.close()
    nodes, tokens, policy = results["tree_nodes"]
    return {
        "s": seconds,
        "tree_nodes": nodes,
        "unique_tokens": int(tokens),
        "policy_tokens": int(policy or 0),
        "trajectories": results["trajectories"][0],
        "selected_trajectories": results["selected_trajectories"][0],
        "longest_selected_tokens": int(results["selected_trajectories"][1] or 0),
        "training_tokens": results["training_tokens"][0],
        "default_selection_trajectories": default[0],
        "default_selection_longest_tokens": int(default[1] or 0),
        "default_selection_training_tokens": default_tokens,
        "tokens_per_s": int(tokens) / seconds,
        "duckdb_memory_limit": DUCKDB_MEMORY_LIMIT,
    }


def stage_pack(work: str, budget: int | None = None, out: str = "packed.parquet") -> dict[str, Any]:
    from trajectory_store.processor import batch_to_table, pack

    con = _connect(work)
    longest = int(
        con.execute("SELECT coalesce(max(n_tokens), 0) FROM selected_trajectories").fetchall()[0][0]
    )
    budget = budget or max(longest + 1, PIECE_BUDGET)
    started = time.perf_counter()
    batch = pack(con, PackingConfig(token_budget=budget))
    seconds = time.perf_counter() - started
    con.close()
    pq.write_table(batch_to_table(batch, step=0), os.path.join(work, out))
    return {
        "s": seconds,
        "token_budget": budget,
        "sequences": len(batch.sequences),
        "longest_sequence": max((len(s) for s in batch.sequences), default=0),
        "tokens": batch.n_tokens,
        "unique_tokens": batch.n_unique_tokens,
        "target_tokens": batch.n_target_tokens,
        "repeated_tokens": batch.n_repeated_tokens,
        "executions": len(batch.advantages),
        "tokens_per_s": batch.n_unique_tokens / seconds,
    }


def stage_train(work: str, packed: str = "packed.parquet", grad_out: str | None = None) -> dict[str, Any]:
    import torch

    from engines.model.weights import load_model
    from engines.train.config import LossConfig
    from engines.train.worker import GradWorker
    from trajectory_store.processor import table_to_sequences

    torch.set_num_threads(ENGINE_THREADS)
    sequences = table_to_sequences(pq.read_table(os.path.join(work, packed)))
    executions = {e for s in sequences for e in s.executions}
    worker = GradWorker(load_model(os.path.join(work, "policy"), dtype=torch.float32), LossConfig())
    started = time.perf_counter()
    loss = 0.0
    for index, sequence in enumerate(sequences):
        loss += worker.accumulate(sequence, len(executions), index, 0).loss
    seconds = time.perf_counter() - started
    if grad_out:
        np.save(os.path.join(work, grad_out), worker.grad.numpy())
    tokens = sum(len(s) for s in sequences)
    return {
        "s": seconds,
        "sequences": len(sequences),
        "tokens": tokens,
        "loss": loss,
        "grad_norm": float(worker.grad.norm()),
        "tokens_per_s": tokens / seconds,
    }


def tree_loss(work: str, packed: str) -> float:
    """The packed trees' loss as a likelihood: -sum over targets of weight x log p (each execution's
    mean token NLL, summed). The policy loss of this group is no check: its two executions' advantages
    (+1, -1) cancel it to float noise at the behaviour policy."""
    import torch

    from engines.model.weights import load_model
    from engines.train.tree import target_logprobs
    from trajectory_store.processor import table_to_sequences

    torch.set_num_threads(ENGINE_THREADS)
    model = load_model(os.path.join(work, "policy"), dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for sequence in table_to_sequences(pq.read_table(os.path.join(work, packed))):
            out = target_logprobs(model, sequence)
            weights = torch.as_tensor(sequence.weights[out.targets.numpy()], dtype=torch.float64)
            total -= float((weights * out.logprobs.double()).sum())
    return total


def stage_piecewise(work: str) -> dict[str, Any]:
    """The same trees trained in one piece and in pieces of the longest path: loss and gradient."""
    whole = stage_pack(work, budget=10**9, out="whole.parquet")
    con = _connect(work)
    longest = int(
        con.execute("SELECT coalesce(max(n_tokens), 0) FROM selected_trajectories").fetchall()[0][0]
    )
    con.close()
    pieces = stage_pack(work, budget=longest + 1, out="pieces.parquet")
    one = stage_train(work, "whole.parquet", grad_out="whole-grad.npy")
    split = stage_train(work, "pieces.parquet", grad_out="pieces-grad.npy")
    g1, g2 = np.load(os.path.join(work, "whole-grad.npy")), np.load(os.path.join(work, "pieces-grad.npy"))
    loss_one, loss_pieces = tree_loss(work, "whole.parquet"), tree_loss(work, "pieces.parquet")
    return {
        "one_piece_sequences": whole["sequences"],
        "pieces": pieces["sequences"],
        "piece_budget": pieces["token_budget"],
        "repeated_tokens": pieces["repeated_tokens"],
        "one_piece_tree_loss": loss_one,
        "pieces_tree_loss": loss_pieces,
        "loss_rel_diff": abs(loss_one - loss_pieces) / abs(loss_one),
        "one_piece_policy_loss": one["loss"],
        "pieces_policy_loss": split["loss"],
        "grad_rel_diff": float(np.linalg.norm(g1 - g2) / max(np.linalg.norm(g1), 1e-30)),
        "one_piece_s": one["s"],
        "pieces_s": split["s"],
    }


def stage_snapshot(work: str, workspace_bytes: int) -> dict[str, Any]:
    """A timed-out execution's workspace of ``workspace_bytes`` (source-like files of 256 KB) stored
    as snapshot rows and blobs, then written back into a fresh folder as grading does."""
    from environments.snapshot_rows import materialise, store_workspace
    from trajectory_store.snapshots import SnapshotStore

    workspace = Path(work, "workspace")
    rng = random.Random(workspace_bytes)
    for i in range(max(1, workspace_bytes // SNAPSHOT_FILE_BYTES)):
        lines = (
            f"{j:6d} {rng.choice(WORDS)}_{rng.choice(WORDS)} = {rng.randrange(10**6)}\n" for j in range(10**9)
        )
        text = "".join(next(lines) for _ in range(SNAPSHOT_FILE_BYTES // 24))
        path = workspace / f"pkg{i % 16}" / f"module_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    size = sum(p.stat().st_size for p in workspace.rglob("*") if p.is_file())
    store = Store(StoreConfig(data_root=os.path.join(work, "snapshots"), campaign="xlong"))
    started = time.perf_counter()
    uri = store_workspace(SnapshotStore(store), 0, "xlong", workspace, problem_id="xlong")
    store_s = time.perf_counter() - started
    started = time.perf_counter()
    snapshots = SnapshotStore(store)
    written = materialise(snapshots, snapshots.read(uri).entries, Path(work, "restored"))
    restore_s = time.perf_counter() - started
    shutil.rmtree(workspace)
    shutil.rmtree(Path(work, "restored"))
    return {
        "s": store_s + restore_s,
        "store_s": store_s,
        "restore_s": restore_s,
        "workspace_bytes": size,
        "files": len(written),
        "bytes_per_s": 2 * size / (store_s + restore_s),
    }


STAGES = {"tree": stage_tree, "pack": stage_pack, "train": stage_train, "piecewise": stage_piecewise}


def run_stage(name: str, work: str, *args: Any) -> dict[str, Any]:
    """Runs a stage in a process of its own; its figures with its peak resident memory."""
    result = os.path.join(work, f"stage-{name}.json")
    command = [sys.executable, "-m", "bench.xlong", "--stage", name, "--work", work, "--result", result]
    command += [str(a) for a in args]
    subprocess.run(command, check=True)
    return json.loads(Path(result).read_text())


def _stage_main(name: str, work: str, result: str, args: list[str]) -> int:
    if name == "rollout":
        figures = stage_rollout(work, int(args[0]), int(args[1]))
    elif name == "snapshot":
        figures = stage_snapshot(work, int(args[0]))
    else:
        figures = STAGES[name](work)
    figures.setdefault("peak_rss_gb", _rss_gb())
    Path(result).write_text(json.dumps(figures))
    return 0
