"""The training benchmark: tree-packed vs per-path training, and elastic satellites.

    gyre bench train --quick    # tiny model (3M), small trees: under three minutes on 2 cores
    gyre bench train            # small model (40M), longer trees

Measured in ONE run on the same model and the same batch (the machine is shared and noisy: read
the ratios):

1. Equality (fp32, tiny model): every policy token's logprob from one tree-packed forward against
   per-path evaluation (max abs difference), and the parameter gradient of the tree-packed loss
   against per-path training with the same weights (relative difference).
2. Throughput: the step's gradient computed tree-packed (one forward/backward per packed
   sequence, unique tokens once, block-sparse tree attention) against naive per-path training (one
   causal forward/backward per selected trajectory on its full path, each target counted once, the
   logits of every path position computed as an HF forward does). Both give the same gradient;
   tokens/s counts the policy tokens trained. The naive/unique token ratio of the batch is the
   limit of the speedup from sharing tokens, reported beside it, with ``tree_efficiency`` =
   speedup / limit (it can pass 1: attention per path costs the square of its length, and the tree
   forward computes logits at the targets only). Two more timings separate those effects: per-path
   training with the logits of the targets only (``tree_over_lean_path_speedup``), and the
   tree-packed step with the dense [T, T] mask (the previous kernel). The attention pairs each
   kernel computes are counted.
3. The same throughput on a more branched workload (``branched``: every call is retried with
   probability 0.5 instead of 0.15), so the speedup shows where trajectories share more; a
   separate section, the main figures stay on the paper-shaped workload.
4. Elastic steps with 0, 1 and 2 satellites (separate processes, one thread each; the core uses one
   thread too): step time, the weight pull time each satellite measured, and the relative
   difference of the reduced gradient to the single-process one.

Prints the figures and writes JSON to bench/results/train.json.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from engines.model.weights import load_model, read_weights, save_weights
from engines.train.config import LossConfig, TrainerConfig
from engines.train.core import CoreTrainer
from engines.train.elastic import ElasticCoordinator
from engines.train.reference import (
    clear_grads,
    compare,
    flat_grad,
    near_policy_behaviour,
    per_path_backward,
    per_path_jobs,
    tree_backward,
)
from engines.train.satellite import satellite_main
from engines.train.tree_attention import build_plan
from engines.train.worker import GradWorker
from trajectory_store import synth
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.processor import PackedBatch, batch_to_table, pack
from trajectory_store.recorder import Recorder
from trajectory_store.storage import Store, StoreConfig

DEFAULT_OUT = "bench/results/train.json"
SIZES = {
    True: {"preset": "tiny", "max_context": 1500, "max_turns": 12, "budget": 2048, "executions": 4},
    False: {"preset": "small", "max_context": 2000, "max_turns": 14, "budget": 2048, "executions": 8},
}


def _model_folder(preset: str, folder: str) -> int:
    from engines.model.build import save_model_folder
    from engines.model.config import ModelConfig

    _, vocab = save_model_folder(ModelConfig(preset=preset, seed=0), folder)
    return vocab


P_RETRY = 0.15  # the paper-shaped workload
P_RETRY_BRANCHED = 0.5  # the branched section


def workload(
    root: str, vocab: int, size: dict[str, Any], p_retry: float = P_RETRY
) -> tuple[PackedBatch, float]:
    """A branched, paper-shaped batch (compression, sub-agents, retries) recorded, selected, packed."""
    config = synth.SynthConfig(
        n_problems=2,
        group_size=size["executions"] // 2,
        vocab_size=vocab,
        system_tokens=120,
        instruction_tokens=150,
        max_turns=size["max_turns"],
        max_context=size["max_context"],
        tool_result_tokens=(30, 400),
        output_tokens=(10, 120),
        summary_tokens=(60, 300),
        p_subagent=0.15,
        p_retry=p_retry,
        seed=7,
        force_shapes=True,
    )
    store = Store(StoreConfig(data_root=root, campaign="bench"))
    recorder = Recorder(store, step=0)
    for record in synth.generate(config):
        record = dict(record)
        if record.pop("type") == "call":
            recorder.record_call_dict(record)
        else:
            recorder.record_execution_dict(record)
    recorder.close()
    con = connect(store, SelectionConfig(j_max=5))
    naive, longest = con.execute("SELECT sum(n_tokens), max(n_tokens) FROM selected_trajectories").fetchall()[
        0
    ]
    budget = max(size["budget"], int(longest))
    return pack(con, PackingConfig(token_budget=budget, advantage="grpo")), float(naive)


def best_times(
    steps: dict[str, Callable[[], Any]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    at_most: dict[str, int] | None = None,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Runs the steps in turn for ``repeats`` rounds (a step named in ``at_most`` in that many rounds at
    most): interleaved, because the machine is shared. The best seconds of each, and its last result."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    results: dict[str, Any] = {}
    for _ in range(repeats):
        for name, step in steps.items():
            if len(seconds[name]) >= (at_most or {}).get(name, repeats):
                continue
            started = clock()
            results[name] = step()
            seconds[name].append(clock() - started)
    return {name: min(times) for name, times in seconds.items() if times}, results


def _attention_pairs(batch: PackedBatch) -> dict[str, int]:
    """(query, key) pairs per layer and head: allowed by the ancestor mask, computed by the block
    kernel, computed by the dense mask, and the causal triangles of per-path training."""
    plans = [build_plan(sequence.parent_index) for sequence in batch.sequences]
    return {
        "allowed": sum(plan.allowed_pairs for plan in plans),
        "blocks": sum(plan.computed_pairs for plan in plans),
        "dense": sum(len(sequence) ** 2 for sequence in batch.sequences),
        "per_path": sum(len(job.path) * (len(job.path) + 1) // 2 for job in per_path_jobs(batch.sequences)),
    }


def _equality(model_dir: str, batch: PackedBatch) -> dict[str, float]:
    agreement = compare(load_model(model_dir, dtype="float32"), batch.sequences, len(batch.advantages))
    return {
        "tree_vs_path_max_abs_logprob_diff": agreement.max_abs_logprob_diff,
        "tree_vs_path_grad_rel_diff": agreement.grad_rel_diff,
    }


def _throughput(
    model_dir: str, batch: PackedBatch, repeats: int = 2, extra: bool = True, extra_repeats: int = 2
) -> dict[str, Any]:
    """Tree-packed (GradWorker) against per-path training; ``extra`` also times the dense-mask kernel and
    the lean per-path baseline (``extra_repeats`` times: the quick run times them once)."""
    config = LossConfig()
    n_executions = len(batch.advantages)
    worker = GradWorker(load_model(model_dir, dtype="float32"), config)
    naive_model = load_model(model_dir, dtype="float32")
    jobs = per_path_jobs(batch.sequences)

    def tree() -> torch.Tensor:
        worker.reset()
        for index, sequence in enumerate(batch.sequences):
            worker.accumulate(sequence, n_executions, index, 0)
        return worker.grad

    def per_path(lean: bool = False) -> torch.Tensor:
        clear_grads(naive_model)
        per_path_backward(naive_model, jobs, n_executions, config, lean=lean)
        return flat_grad(naive_model)

    def dense() -> torch.Tensor:
        clear_grads(naive_model)
        tree_backward(naive_model, batch.sequences, n_executions, config, kernel="dense")
        return flat_grad(naive_model)

    steps: dict[str, Callable[[], torch.Tensor]] = {"tree": tree, "per_path": per_path}
    if extra:
        steps.update(dense=dense, lean=lambda: per_path(lean=True))
    best, grads = best_times(steps, repeats, at_most={"dense": extra_repeats, "lean": extra_repeats})
    targets = batch.n_target_tokens
    naive_tokens = sum(len(job.path) for job in jobs)
    speedup = best["per_path"] / best["tree"]
    limit = naive_tokens / batch.n_tokens
    figures: dict[str, Any] = {
        "tree_s": best["tree"],
        "per_path_s": best["per_path"],
        "tree_tokens_per_s": targets / best["tree"],
        "per_path_tokens_per_s": targets / best["per_path"],
        "tree_over_path_speedup": speedup,
        "naive_over_unique_tokens": limit,
        "tree_efficiency": speedup / limit,
        "tree_tokens": batch.n_tokens,
        "per_path_tokens": naive_tokens,
        "target_tokens": targets,
        "tree_vs_path_grad_rel_diff_at_speed": float(
            (worker.grad - grads["per_path"]).norm() / grads["per_path"].norm()
        ),
        "attention_pairs": _attention_pairs(batch),
    }
    if extra:
        figures["tree_dense_kernel_s"] = best["dense"]
        figures["dense_kernel_over_path_speedup"] = best["per_path"] / best["dense"]
        figures["blocks_over_dense_kernel_speedup"] = best["dense"] / best["tree"]
        figures["per_path_lean_s"] = best["lean"]
        figures["tree_over_lean_path_speedup"] = best["lean"] / best["tree"]
        figures["tree_efficiency_lean"] = best["lean"] / best["tree"] / limit
        for name, key in (("dense", "dense"), ("lean_path", "lean")):
            figures[f"{name}_vs_tree_grad_rel_diff"] = float(
                (grads[key].double() - worker.grad).norm() / worker.grad.norm()
            )
    return figures


def _batch_figures(batch: PackedBatch) -> dict[str, int]:
    return {
        "sequences": len(batch.sequences),
        "executions": len(batch.advantages),
        "tokens": batch.n_tokens,
        "targets": batch.n_target_tokens,
        "repeated_tokens": batch.n_repeated_tokens,
        "shared_tokens": batch.n_shared_tokens,  # a root's prefix packed once for several trees
    }


def _branched(model_dir: str, root: str, vocab: int, size: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The throughput section on a workload whose calls are retried far more often."""
    batch, naive_selected = workload(root, vocab, size, p_retry=P_RETRY_BRANCHED)
    near_policy_behaviour(batch.sequences, load_model(model_dir, dtype="float32"))
    figures: dict[str, Any] = {"p_retry": P_RETRY_BRANCHED, "batch": _batch_figures(batch)}
    figures.update(_throughput(model_dir, batch, repeats=repeats, extra=False))
    figures["selected_trajectory_tokens"] = naive_selected
    return figures


def _satellite_entry(queue, host: str, port: int, step: int, model_dir: str, ready) -> None:
    queue.put(satellite_main(host, port, step, model_dir, ready=ready, threads=1))


def _elastic(model_dir: str, batch: PackedBatch, workdir: str) -> dict[str, Any]:
    buffer = io.BytesIO()
    pq.write_table(batch_to_table(batch, 0), buffer)
    batch_uri = os.path.join(workdir, "batch.parquet")
    Path(batch_uri).write_bytes(buffer.getvalue())
    weights_dir = os.path.join(workdir, "fast")
    os.makedirs(weights_dir, exist_ok=True)
    context = multiprocessing.get_context("spawn")
    results: dict[str, Any] = {}
    reference_grad = None
    for n_satellites in (0, 1, 2):
        core = CoreTrainer(load_model(model_dir, dtype="float32"), TrainerConfig(lr=1e-5, zero_stage=1))
        coordinator = ElasticCoordinator(core)
        queue = context.Queue()
        ready = [context.Event() for _ in range(n_satellites)]
        processes = [
            context.Process(
                target=_satellite_entry,
                args=(queue, coordinator.host, coordinator.port, 0, model_dir, event),
                daemon=True,
            )
            for event in ready
        ]
        for process in processes:
            process.start()
        for event in ready:
            event.wait(300)
        report = coordinator.run_step(
            0, batch.sequences, len(batch.advantages), batch_uri=batch_uri, weights_dir=weights_dir
        )
        satellites = [queue.get(timeout=120) for _ in processes]
        for process in processes:
            process.join(timeout=60)
        grad = core.last_grad.clone()
        if reference_grad is None:
            reference_grad = grad
        results[f"satellites_{n_satellites}"] = {
            "step_s": report.timings["step"],
            "compute_s": report.timings["compute"],
            "members": report.members,
            "micro_batches_by_participant": {str(k): len(v) for k, v in report.by_participant.items()},
            "weight_pull_s": [s["pull_s"] for s in satellites],
            "grad_rel_diff_vs_single": float((grad - reference_grad).norm() / reference_grad.norm()),
        }
        coordinator.close()
    weights = os.path.join(weights_dir, "pull.safetensors")
    save_weights(load_model(model_dir, dtype="float32").state_dict(), weights, 0)
    started = time.perf_counter()
    read_weights(weights, expected_version=0)
    results["weight_pull_in_core_s"] = time.perf_counter() - started
    results["weight_bytes"] = os.path.getsize(weights)
    results["elastic_grad_rel_diff"] = max(
        results[f"satellites_{n}"]["grad_rel_diff_vs_single"] for n in (1, 2)
    )
    return results


def run(quick: bool) -> dict[str, Any]:
    size = SIZES[quick]
    torch.set_num_threads(1)  # the core and each satellite get one thread: the comparison is per cell
    with tempfile.TemporaryDirectory(prefix="gyre-bench-train-") as workdir:
        started = time.perf_counter()
        model_dir = os.path.join(workdir, "policy")
        vocab = _model_folder(size["preset"], model_dir)
        # token ids the tiny model (the equality check) and the measured model both have
        batch, naive_selected = workload(os.path.join(workdir, "data"), min(vocab, 4096), size)
        near_policy_behaviour(batch.sequences, load_model(model_dir, dtype="float32"))
        tiny_dir = model_dir
        if size["preset"] != "tiny":  # the equality check runs on the tiny model, whatever the run
            tiny_dir = os.path.join(workdir, "tiny")
            _model_folder("tiny", tiny_dir)
        figures: dict[str, Any] = {"preset": size["preset"], "quick": quick}
        figures.update(_equality(tiny_dir, batch))
        figures.update(_throughput(model_dir, batch, extra_repeats=1 if quick else 2))
        figures["selected_trajectory_tokens"] = naive_selected
        figures["p_retry"] = P_RETRY
        figures["branched"] = _branched(
            model_dir, os.path.join(workdir, "branched"), min(vocab, 4096), size, repeats=1 if quick else 2
        )
        elastic = _elastic(model_dir, batch, workdir)
        figures["elastic_grad_rel_diff"] = elastic.pop("elastic_grad_rel_diff")
        figures["elastic"] = elastic
        figures["step_s_by_satellites"] = {n: elastic[f"satellites_{n}"]["step_s"] for n in (0, 1, 2)}
        figures["batch"] = _batch_figures(batch)
        figures["environment"] = {
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "threads_per_cell": 1,
            "platform": platform.platform(),
        }
        figures["wall_s"] = time.perf_counter() - started
    return figures


def main(quick: bool = False, out: str = DEFAULT_OUT) -> int:
    figures = run(quick)
    branched = figures["branched"]
    pairs = figures["attention_pairs"]
    lines = [
        f"model preset                         {figures['preset']}",
        f"batch                                {figures['batch']}",
        f"tree vs path: max |logprob diff|     {figures['tree_vs_path_max_abs_logprob_diff']:.2e}",
        f"tree vs path: gradient rel. diff     {figures['tree_vs_path_grad_rel_diff']:.2e}",
        f"tree-packed training                 {figures['tree_tokens_per_s']:.0f} policy tokens/s",
        f"per-path training                    {figures['per_path_tokens_per_s']:.0f} policy tokens/s",
        f"speedup (goal >= 3x)                 {figures['tree_over_path_speedup']:.2f}x",
        f"naive / unique tokens (the limit)    {figures['naive_over_unique_tokens']:.2f}x",
        f"tree efficiency (speedup / limit)    {figures['tree_efficiency']:.2f}",
        f"per-path, logits at targets only     {figures['tree_over_lean_path_speedup']:.2f}x speedup, "
        f"efficiency {figures['tree_efficiency_lean']:.2f}",
        f"dense-mask kernel (before)           {figures['dense_kernel_over_path_speedup']:.2f}x per-path speed; "
        f"blocks are {figures['blocks_over_dense_kernel_speedup']:.2f}x faster",
        f"attention pairs blocks/dense/path    {pairs['blocks']} / {pairs['dense']} / {pairs['per_path']} "
        f"(allowed {pairs['allowed']})",
        f"branched workload (p_retry {branched['p_retry']})     {branched['batch']}",
        f"  speedup / limit / efficiency       {branched['tree_over_path_speedup']:.2f}x / "
        f"{branched['naive_over_unique_tokens']:.2f}x / {branched['tree_efficiency']:.2f}",
        f"  tree vs path gradient rel. diff    {branched['tree_vs_path_grad_rel_diff_at_speed']:.2e}",
        *[
            f"step with {n} satellite(s)              {s:.2f} s"
            for n, s in figures["step_s_by_satellites"].items()
        ],
        f"weight pull (satellites)             {figures['elastic']['satellites_2']['weight_pull_s']}",
        f"elastic gradient rel. diff           {figures['elastic_grad_rel_diff']:.2e}",
        f"wall time                            {figures['wall_s']:.1f} s",
    ]
    print("\n".join(lines))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as handle:
        json.dump(figures, handle, indent=1, default=str)
    print(f"wrote {out}")
    return 0
