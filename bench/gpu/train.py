"""The train section: tree-packed against per-path training (engines/train/reference.py) on
bench/train.py's packed branched batch, per preset, GradWorker timed apart; fp32 equality of
logprobs and gradients on the most branched sequence."""

from __future__ import annotations

import time
from typing import Any

import torch

from bench.engine_workload import device_clock
from bench.gpu.run import Run, attempt, free
from bench.train import best_times
from engines.train.config import LossConfig
from engines.train.reference import (
    PathJob,
    clear_grads,
    compare,
    near_policy_behaviour,
    per_path_backward,
    tree_backward,
)
from engines.train.worker import GradWorker
from trajectory_store.processor import PackedSequence


def section_train(run: Run, figures: dict, deadline: float) -> None:
    plan, device = run.plan, run.device
    batch = run.batch()
    figures["batch"] = run.report["batch"]
    figures["attention"] = (
        "block-sparse tree attention over SDPA (engines/train/tree_attention.py, block 128)"
    )
    figures["runs"] = []
    perturbed = False
    for preset in plan.train_presets:
        if time.monotonic() > deadline:
            figures.setdefault("skipped", []).append(f"{preset}: the section's time ran out")
            continue
        model = attempt(figures, f"{preset} load", lambda preset=preset: run.load(preset))
        if model is None:
            continue
        if not perturbed:
            near_policy_behaviour(batch.sequences, model)
            perturbed = True
        result = attempt(figures, preset, lambda model=model: _throughput(run, model))
        if result is not None:
            figures["runs"].append({"preset": preset, "dtype": plan.dtype, **result})
        del model
        free(device)
        run.write()
    if time.monotonic() > deadline:
        figures.setdefault("skipped", []).append("fp32 equality: the section's time ran out")
    else:
        equality = attempt(figures, "fp32 equality", lambda: _equality(run, plan.train_presets[0]))
        if equality is not None:
            figures["equality_fp32"] = equality


def _throughput(run: Run, model: torch.nn.Module) -> dict[str, Any]:
    batch, jobs, device = run.batch(), run.jobs(), run.device
    n_executions, config = len(batch.advantages), LossConfig()
    model.train()

    def tree(sequences: list[PackedSequence] = batch.sequences) -> None:
        tree_backward(model, sequences, n_executions, config)
        clear_grads(model)

    def per_path(jobs: list[PathJob] = jobs) -> None:
        per_path_backward(model, jobs, n_executions, config)
        clear_grads(model)

    if device.type == "cuda":  # warm-up: kernels, cuBLAS handles, the caching allocator
        tree(batch.sequences[:1])
        per_path(jobs[:1])
    best, _ = best_times(
        {"tree": tree, "per_path": per_path}, run.plan.train_repeats, lambda: device_clock(device)
    )
    worker = GradWorker(model, config)
    started = device_clock(device)
    for index, sequence in enumerate(batch.sequences):
        worker.accumulate(sequence, n_executions, index, 0)
    worker_s = device_clock(device) - started
    clear_grads(model)
    del worker
    targets = batch.n_target_tokens
    path_tokens = sum(len(job.path) for job in jobs)
    tree_s, path_s = best["tree"], best["per_path"]
    return {
        "tree_s": round(tree_s, 4),
        "per_path_s": round(path_s, 4),
        "tree_target_tokens_per_s": round(targets / tree_s, 1),
        "per_path_target_tokens_per_s": round(targets / path_s, 1),
        "tree_tokens_per_s": round(batch.n_tokens / tree_s, 1),
        "per_path_tokens_per_s": round(path_tokens / path_s, 1),
        "tree_over_path_speedup": round(path_s / tree_s, 2),
        "naive_over_unique_tokens": round(path_tokens / batch.n_tokens, 2),
        "grad_worker_s": round(worker_s, 4),
        "grad_worker_over_tree": round(worker_s / tree_s, 2),
        "grad_worker_note": "GradWorker = tree fwd+bwd + adding every parameter's gradient into its CPU fp32 buffer",
    }


def _equality(run: Run, preset: str) -> dict[str, Any]:
    """fp32, one packed sequence: tree-packed vs per-path logprobs, and GradWorker's gradient vs per-path."""
    batch = run.batch()
    paths = {id(s): sum(job.sequence is s for job in run.jobs()) for s in batch.sequences}
    sequence = max(batch.sequences, key=lambda s: (paths[id(s)], -len(s)))  # the most branched
    agreement = compare(run.load(preset, "float32"), [sequence], len(batch.advantages))
    return {
        "preset": preset,
        "sequence_tokens": len(sequence),
        "targets": int(sequence.loss_mask.sum()),
        "paths": agreement.paths,
        "max_abs_logprob_diff": agreement.max_abs_logprob_diff,
        "grad_rel_diff": agreement.grad_rel_diff,
        "reference_grad_norm": agreement.reference_grad_norm,
        "tolerance_note": "DESIGN.md 5: equal within fp32 tolerance (1e-5 relative)",
    }
