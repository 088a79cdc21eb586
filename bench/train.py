"""The training benchmark: tree-packed vs per-path training, and elastic satellites.

    gyre bench train --quick    # tiny model (3M), small trees: under two minutes
    gyre bench train            # small model (40M), longer trees

Measured in ONE run on the same model and the same batch (the machine is shared and noisy: read
the ratios):

1. Equality (fp32, tiny model): every policy token's logprob from one tree-packed forward against
   per-path evaluation (max abs difference), and the parameter gradient of the tree-packed loss
   against per-path training with the same weights (relative difference).
2. Throughput: the step's gradient computed tree-packed (one forward/backward per packed
   sequence, unique tokens once) against naive per-path training (one causal forward/backward per
   selected trajectory on its full path, each target counted once). Both give the same gradient;
   tokens/s counts the policy tokens trained. The limit of the speedup is the naive/unique token
   ratio of the batch, reported beside it.
3. Elastic steps with 0, 1 and 2 satellites (separate processes, one thread each; the core uses one
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


def _workload(root: str, vocab: int, size: dict[str, Any]) -> tuple[PackedBatch, float]:
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
        p_retry=0.15,
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


def _per_path_step(model: torch.nn.Module, jobs, n_executions: int, config: LossConfig) -> torch.Tensor:
    """Naive training: one causal forward/backward per trajectory; returns the flat gradient."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    for sequence, path, targets in jobs:
        positions = np.searchsorted(path, targets)  # where each target sits on the path (path is sorted)
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


def _throughput(model_dir: str, batch: PackedBatch, repeats: int = 2) -> dict[str, float]:
    config = LossConfig()
    n_executions = len(batch.advantages)
    worker = GradWorker(load_policy_model(model_dir), config)
    naive_model = load_policy_model(model_dir)
    jobs = _per_path_jobs(batch)
    tree_s, naive_s = [], []
    for _ in range(repeats):  # interleaved, best of each: the machine is shared
        worker.reset()
        started = time.perf_counter()
        for index, sequence in enumerate(batch.sequences):
            worker.accumulate(sequence, n_executions, index, 0)
        tree_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        naive_grad = _per_path_step(naive_model, jobs, n_executions, config)
        naive_s.append(time.perf_counter() - started)
    targets = batch.n_target_tokens
    naive_tokens = sum(len(path) for _, path, _ in jobs)
    return {
        "tree_s": min(tree_s),
        "per_path_s": min(naive_s),
        "tree_tokens_per_s": targets / min(tree_s),
        "per_path_tokens_per_s": targets / min(naive_s),
        "tree_over_path_speedup": min(naive_s) / min(tree_s),
        "naive_over_unique_tokens": naive_tokens / batch.n_tokens,
        "tree_tokens": batch.n_tokens,
        "per_path_tokens": naive_tokens,
        "target_tokens": targets,
        "tree_vs_path_grad_rel_diff_at_speed": float((worker.grad - naive_grad).norm() / naive_grad.norm()),
    }


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
        figures.update(_throughput(model_dir, batch))
        figures["selected_trajectory_tokens"] = naive_selected
        elastic = _elastic(model_dir, batch, workdir)
        figures["elastic_grad_rel_diff"] = elastic.pop("elastic_grad_rel_diff")
        figures["elastic"] = elastic
        figures["step_s_by_satellites"] = {n: elastic[f"satellites_{n}"]["step_s"] for n in (0, 1, 2)}
        figures["batch"] = {
            "sequences": len(batch.sequences),
            "executions": len(batch.advantages),
            "tokens": batch.n_tokens,
            "targets": batch.n_target_tokens,
            "repeated_tokens": batch.n_repeated_tokens,
        }
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
    lines = [
        f"model preset                         {figures['preset']}",
        f"batch                                {figures['batch']}",
        f"tree vs path: max |logprob diff|     {figures['tree_vs_path_max_abs_logprob_diff']:.2e}",
        f"tree vs path: gradient rel. diff     {figures['tree_vs_path_grad_rel_diff']:.2e}",
        f"tree-packed training                 {figures['tree_tokens_per_s']:.0f} policy tokens/s",
        f"per-path training                    {figures['per_path_tokens_per_s']:.0f} policy tokens/s",
        f"speedup (goal >= 3x)                 {figures['tree_over_path_speedup']:.2f}x",
        f"naive / unique tokens (the limit)    {figures['naive_over_unique_tokens']:.2f}x",
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
