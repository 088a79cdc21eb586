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
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from engines.train.config import LossConfig, TrainerConfig
from engines.train.core import CoreTrainer, load_weights
from engines.train.elastic import ElasticCoordinator
from engines.train.loss import policy_loss
from engines.train.satellite import load_policy_model, satellite_main
from engines.train.tree import path_logprobs, target_logprobs
from engines.train.tree_attention import build_plan
from engines.train.worker import GradWorker
from trajectory_store import synth
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.processor import PackedBatch, PackedSequence, batch_to_table, pack
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


def _workload(
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


def _perturb(batch: PackedBatch, model: torch.nn.Module) -> None:
    """Behaviour logprobs near the current policy's (as after a real rollout), so ratios are near 1."""
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for sequence in batch.sequences:
            out = target_logprobs(model, sequence)
            noisy = out.logprobs.numpy() + rng.normal(0, 0.05, out.logprobs.numel()).astype(np.float32)
            behaviour = np.zeros(len(sequence), dtype=np.float32)
            behaviour[out.targets.numpy()] = np.minimum(noisy, 0)
            sequence.behaviour_logprobs = behaviour


def _path(sequence: PackedSequence, index: int) -> np.ndarray:
    path = []
    while index >= 0:
        path.append(index)
        index = int(sequence.parent_index[index])
    return np.array(path[::-1])


def _per_path_jobs(batch: PackedBatch) -> list[tuple[PackedSequence, np.ndarray, np.ndarray]]:
    """(sequence, path indices, target indices on that path): every selected trajectory's path, each
    target on the first path holding it. A split tree can leave targets whose leaves went to the
    next sequence: they get the path to the deepest of them."""
    jobs = []
    for sequence in batch.sequences:
        taken = np.zeros(len(sequence), dtype=bool)
        ends = [leaf for _, _, leaf in sequence.leaves]
        while True:
            for end in ends:
                path = _path(sequence, end)
                mine = path[sequence.loss_mask[path] & ~taken[path]]
                taken[mine] = True
                jobs.append((sequence, path, mine))
            left = np.flatnonzero(sequence.loss_mask & ~taken)
            if not left.size:
                break
            ends = [int(left[np.argmax(sequence.position_ids[left])])]
    return jobs


def _logprobs_at_targets(model: torch.nn.Module, tokens: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """log p(tokens[k] | tokens[:k]) for k in positions, the output projection at those k - 1 only."""
    input_ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    hidden = model.base_model(input_ids=input_ids).last_hidden_state[0, torch.as_tensor(positions - 1)]
    log_probs = torch.log_softmax(model.get_output_embeddings()(hidden).float(), -1)
    return log_probs.gather(1, input_ids[0, torch.as_tensor(positions), None])[:, 0]


def _per_path_step(
    model: torch.nn.Module, jobs, n_executions: int, config: LossConfig, lean: bool = False
) -> torch.Tensor:
    """Naive training: one causal forward/backward per trajectory; returns the flat gradient. The
    logits of every path position, as an HF forward gives them, or (``lean``) of the targets only."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    for sequence, path, targets in jobs:
        positions = np.searchsorted(path, targets)  # where each target sits on the path (path is sorted)
        if lean:
            logprobs = _logprobs_at_targets(model, sequence.token_ids[path], positions)
        else:
            logprobs = path_logprobs(model, sequence.token_ids[path])[positions - 1]

        def at(array: np.ndarray, targets: np.ndarray = targets) -> torch.Tensor:
            return torch.as_tensor(array[targets], dtype=torch.float32)

        terms = policy_loss(
            logprobs,
            at(sequence.behaviour_logprobs),
            at(sequence.advantages),
            at(sequence.weights),
            n_executions,
            config,
        )
        terms.loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in params])


def _tree_step(model: torch.nn.Module, batch: PackedBatch, config: LossConfig, kernel: str) -> torch.Tensor:
    """GradWorker.accumulate's loss and backward for every sequence, with the given attention kernel."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    for sequence in batch.sequences:
        out = target_logprobs(model, sequence, kernel=kernel)
        targets = out.targets.numpy()

        def at(array: np.ndarray, targets: np.ndarray = targets) -> torch.Tensor:
            return torch.as_tensor(array[targets], dtype=torch.float32)

        terms = policy_loss(
            out.logprobs,
            at(sequence.behaviour_logprobs),
            at(sequence.advantages),
            at(sequence.weights),
            len(batch.advantages),
            config,
            entropy=out.entropy,
        )
        terms.loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in params])


def _attention_pairs(batch: PackedBatch) -> dict[str, int]:
    """(query, key) pairs per layer and head: allowed by the ancestor mask, computed by the block
    kernel, computed by the dense mask, and the causal triangles of per-path training."""
    plans = [build_plan(sequence.parent_index) for sequence in batch.sequences]
    return {
        "allowed": sum(plan.allowed_pairs for plan in plans),
        "blocks": sum(plan.computed_pairs for plan in plans),
        "dense": sum(len(sequence) ** 2 for sequence in batch.sequences),
        "per_path": sum(len(path) * (len(path) + 1) // 2 for _, path, _ in _per_path_jobs(batch)),
    }


def _equality(model_dir: str, batch: PackedBatch) -> dict[str, float]:
    model = load_policy_model(model_dir).eval()
    jobs = _per_path_jobs(batch)
    worst = 0.0
    with torch.no_grad():
        trees = {id(sequence): target_logprobs(model, sequence) for sequence in batch.sequences}
        for sequence, path, targets in jobs:  # one forward per path gives every target on it
            tree = trees[id(sequence)]
            by_index = dict(zip(tree.targets.tolist(), tree.logprobs.tolist(), strict=True))
            reference = path_logprobs(model, sequence.token_ids[path])
            for target in targets.tolist():
                position = int(np.searchsorted(path, target))
                worst = max(worst, abs(by_index[target] - reference[position - 1].item()))
    config = LossConfig()
    worker = GradWorker(load_policy_model(model_dir), config)
    for index, sequence in enumerate(batch.sequences):
        worker.accumulate(sequence, len(batch.advantages), index, 0)
    reference = _per_path_step(load_policy_model(model_dir), jobs, len(batch.advantages), config)
    return {
        "tree_vs_path_max_abs_logprob_diff": worst,
        "tree_vs_path_grad_rel_diff": float((worker.grad - reference).norm() / reference.norm()),
    }


def _throughput(
    model_dir: str, batch: PackedBatch, repeats: int = 2, extra: bool = True, extra_repeats: int = 2
) -> dict[str, Any]:
    """Tree-packed against per-path training; ``extra`` also times the dense-mask kernel and the lean
    per-path baseline (``extra_repeats`` times: the quick run times them once)."""
    config = LossConfig()
    n_executions = len(batch.advantages)
    worker = GradWorker(load_policy_model(model_dir), config)
    naive_model = load_policy_model(model_dir)
    jobs = _per_path_jobs(batch)
    tree_s, naive_s, dense_s, lean_s = [], [], [], []
    for _ in range(repeats):  # interleaved, best of each: the machine is shared
        worker.reset()
        started = time.perf_counter()
        for index, sequence in enumerate(batch.sequences):
            worker.accumulate(sequence, n_executions, index, 0)
        tree_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        naive_grad = _per_path_step(naive_model, jobs, n_executions, config)
        naive_s.append(time.perf_counter() - started)
        if extra and len(dense_s) < extra_repeats:
            started = time.perf_counter()
            dense_grad = _tree_step(naive_model, batch, config, "dense")
            dense_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            lean_grad = _per_path_step(naive_model, jobs, n_executions, config, lean=True)
            lean_s.append(time.perf_counter() - started)
    targets = batch.n_target_tokens
    naive_tokens = sum(len(path) for _, path, _ in jobs)
    speedup = min(naive_s) / min(tree_s)
    limit = naive_tokens / batch.n_tokens
    figures: dict[str, Any] = {
        "tree_s": min(tree_s),
        "per_path_s": min(naive_s),
        "tree_tokens_per_s": targets / min(tree_s),
        "per_path_tokens_per_s": targets / min(naive_s),
        "tree_over_path_speedup": speedup,
        "naive_over_unique_tokens": limit,
        "tree_efficiency": speedup / limit,
        "tree_tokens": batch.n_tokens,
        "per_path_tokens": naive_tokens,
        "target_tokens": targets,
        "tree_vs_path_grad_rel_diff_at_speed": float((worker.grad - naive_grad).norm() / naive_grad.norm()),
        "attention_pairs": _attention_pairs(batch),
    }
    if extra:
        figures["tree_dense_kernel_s"] = min(dense_s)
        figures["dense_kernel_over_path_speedup"] = min(naive_s) / min(dense_s)
        figures["blocks_over_dense_kernel_speedup"] = min(dense_s) / min(tree_s)
        figures["per_path_lean_s"] = min(lean_s)
        figures["tree_over_lean_path_speedup"] = min(lean_s) / min(tree_s)
        figures["tree_efficiency_lean"] = min(lean_s) / min(tree_s) / limit
        for name, grad in (("dense", dense_grad), ("lean_path", lean_grad)):
            figures[f"{name}_vs_tree_grad_rel_diff"] = float(
                (grad.double() - worker.grad).norm() / worker.grad.norm()
            )
    return figures


def _batch_figures(batch: PackedBatch) -> dict[str, int]:
    return {
        "sequences": len(batch.sequences),
        "executions": len(batch.advantages),
        "tokens": batch.n_tokens,
        "targets": batch.n_target_tokens,
        "repeated_tokens": batch.n_repeated_tokens,
    }


def _branched(model_dir: str, root: str, vocab: int, size: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The throughput section on a workload whose calls are retried far more often."""
    batch, naive_selected = _workload(root, vocab, size, p_retry=P_RETRY_BRANCHED)
    _perturb(batch, load_policy_model(model_dir).eval())
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
        core = CoreTrainer(load_policy_model(model_dir), TrainerConfig(lr=1e-5, zero_stage=1))
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
    from engines.train.core import save_weights

    save_weights(load_policy_model(model_dir).state_dict(), weights, 0)
    started = time.perf_counter()
    load_weights(weights, expected_version=0)
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
        batch, naive_selected = _workload(os.path.join(workdir, "data"), min(vocab, 4096), size)
        _perturb(batch, load_policy_model(model_dir).eval())
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
