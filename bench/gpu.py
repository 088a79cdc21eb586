"""The GPU check (issue 6): the rollout engine, tree-packed training, the DeepSpeed core and role
switches, measured in ONE run on one device; JSON out.

    bash bench/gpu_check.sh                                   # the one command on the GPU machine
    python bench/gpu.py --budget 420 --out bench/results/gpu.json [--quick]
    python bench/gpu.py --budget 200 --sections deepspeed,migration    # a rerun: other sections kept

On CUDA it uses the gpu-0.5b and gpu-1.5b presets (seeded random weights built locally with
``save_model_folder``: nothing is downloaded) in bf16. Without CUDA the same code falls back to the
tiny preset and tiny sizes, so the script is tested where there is no GPU (tests/test_gpu_check.py).

Sections, in order (a failure is recorded as ``"status": "error"`` with the traceback's tail and
the next section still runs; one failed measurement inside a section goes under its ``"errors"`` and
the section is ``"partial"``; a section that cannot start before the budget runs out is recorded as
``"skipped"`` with the reason; the JSON is rewritten after every section and sub-step, so a killed
run leaves what it measured):

    engine       a multi-turn agent workload (each turn's prompt = previous prompt + output + a tool
                 result), batch 1/16/64: our engine vs HF ``generate`` on the same prompts (HF: one
                 batched call per turn, left padding, the full context every turn), prefix-cache hits
    train        bench/train.py's packed branched batch: tree-packed fwd+bwd vs per-path on the same
                 model and batch; GradWorker (its gradient sum lives in a CPU buffer for the gloo
                 reduction) timed apart; fp32 equality of logprobs and gradients on one sequence
    deepspeed    CoreTrainer (ZeRO-2, bf16): one micro-batch by its worker, apply (surrogate backward
                 + optimizer step), weight sync back to the worker; mean step time, peak memory
    role_switch  rollout->train: engine.sleep(), the trainer's weights to the device, one micro-batch
                 fwd+bwd; train->rollout: engine.wake() with the trainer's NEW weights, the trainer
                 offloaded to the host, the first token (goals <= 3 s and <= 1.5 s)
    migration    two engine processes on the one device: a session's KV moved A->B over /dev/shm
                 (ShmTransport) and over torch IPC (TorchIpcTransport: a CUDA IPC handle on a GPU)
                 vs recomputing the context on B

Timings synchronize the device around each measured interval; figures are wall-clock.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from bench.engine_workload import agent_turns, cache_figures, device_clock
from bench.train import best_times, workload
from engines.rollout.config import EngineConfig
from engines.rollout.engine import RolloutEngine
from engines.rollout.messages import GenerateRequest, SamplingParams
from engines.rollout.migration import ShmHandle, ShmTransport, TorchIpcHandle, TorchIpcTransport
from engines.train.config import LossConfig, TrainerConfig
from engines.train.reference import (
    PathJob,
    clear_grads,
    compare,
    near_policy_behaviour,
    per_path_backward,
    per_path_jobs,
    tree_backward,
)
from engines.train.worker import GradWorker
from trajectory_store.processor import PackedBatch, PackedSequence

DEFAULT_OUT = "bench/results/gpu.json"
SECTIONS = ("engine", "train", "deepspeed", "role_switch", "migration")
MEASURED = {  # the key that holds a section's figures once it measured anything
    "engine": "runs",
    "train": "runs",
    "deepspeed": "mean_step_s",
    "role_switch": "cycles",
    "migration": "runs",
}
GOALS_S = {"rollout_to_train": 3.0, "train_to_rollout": 1.5}


# -- plan ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU plan, or the CPU fallback's tiny one."""

    dtype: Literal["bfloat16", "float32"]
    engine_presets: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    turns: int
    max_tokens: int
    first_prompt_tokens: tuple[int, int]
    tool_tokens: tuple[int, int]
    train_presets: tuple[str, ...]
    train_size: dict  # bench/train.py's workload sizes
    train_sequences: int | None  # packed sequences trained (None: all of them)
    train_repeats: int
    deepspeed_preset: str
    deepspeed_steps: int
    switch_preset: str
    switch_context: int
    migration_preset: str
    migration_contexts: tuple[int, ...]
    migration_repeats: int
    shares: dict  # section -> share of the remaining budget it may use
    min_s: dict  # section -> seconds it needs to be worth starting

    def presets(self, sections: tuple[str, ...]) -> list[str]:
        """The presets the given sections use, each once."""
        used = {
            "engine": self.engine_presets,
            "train": self.train_presets,
            "deepspeed": (self.deepspeed_preset,),
            "role_switch": (self.switch_preset,),
            "migration": (self.migration_preset,),
        }
        return list(dict.fromkeys(preset for name in sections for preset in used[name]))


def make_plan(cuda: bool, quick: bool) -> Plan:
    shares = {"engine": 0.35, "train": 0.2, "deepspeed": 0.15, "role_switch": 0.1, "migration": 0.2}
    if cuda:
        big = ("gpu-0.5b",) if quick else ("gpu-0.5b", "gpu-1.5b")
        role = "gpu-0.5b" if quick else "gpu-1.5b"
        return Plan(
            dtype="bfloat16",
            engine_presets=big,
            batch_sizes=(1, 16) if quick else (1, 16, 64),
            turns=3,
            max_tokens=64,
            first_prompt_tokens=(200, 400),
            tool_tokens=(100, 300),
            train_presets=big,
            train_size={"max_context": 6000, "max_turns": 24, "budget": 8192, "executions": 8},
            train_sequences=None,
            train_repeats=2,
            deepspeed_preset=role,
            deepspeed_steps=3,
            switch_preset=role,
            switch_context=2048,
            migration_preset=role,
            migration_contexts=(2048,) if quick else (2048, 8192),
            migration_repeats=3,
            shares=shares,
            min_s={"engine": 40, "train": 25, "deepspeed": 30, "role_switch": 20, "migration": 40},
        )
    return Plan(
        dtype="float32",
        engine_presets=("tiny",),
        batch_sizes=(1, 4),
        turns=2 if quick else 3,
        max_tokens=8 if quick else 16,
        first_prompt_tokens=(32, 64),
        tool_tokens=(20, 60),
        train_presets=("tiny",),
        train_size={"max_context": 400, "max_turns": 4, "budget": 512, "executions": 4},
        train_sequences=3 if quick else None,
        train_repeats=1 if quick else 2,
        deepspeed_preset="tiny",
        deepspeed_steps=1 if quick else 2,
        switch_preset="tiny",
        switch_context=128 if quick else 256,
        migration_preset="tiny",
        migration_contexts=(128,) if quick else (256, 1024),
        migration_repeats=1 if quick else 2,
        shares=shares,
        min_s={"engine": 3, "train": 3, "deepspeed": 3, "role_switch": 3, "migration": 5},
    )


# -- helpers ------------------------------------------------------------------------------------------
def _load(folder: str, dtype: str, device: torch.device | str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="sdpa", dtype=getattr(torch, dtype), local_files_only=True
    )
    return model.to(device).eval()


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _model_key(preset: str) -> str:
    """Names a built model folder by what makes it: the preset, engines/model's code, transformers."""
    import transformers

    import engines.model.build as build
    from engines.model.config import PRESETS

    digest = hashlib.sha256(f"{PRESETS[preset]!r}/{transformers.__version__}".encode())
    for path in sorted(Path(build.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _attempt(figures: dict, label: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None with its traceback's tail under figures["errors"][label]: one failed measurement
    never hides the others of its section."""
    try:
        return fn()
    except Exception:
        figures.setdefault("errors", {})[label] = _tail(traceback.format_exc(), 2000)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


# -- the run: budget, models, the shared batch, the JSON ------------------------------------------------
class Run:
    """One invocation. Attributes: plan, device, report (the JSON), deadline (monotonic seconds)."""

    def __init__(
        self,
        out: str,
        budget_s: float,
        quick: bool,
        models_dir: str,
        copy_to: str | None,
        sections: tuple[str, ...] = SECTIONS,
    ):
        self.started = time.monotonic()
        self.selected = sections
        self.deadline = self.started + budget_s
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.plan = make_plan(self.cuda, quick)
        if not self.cuda:  # the CPU fallback shares a small machine: one thread, as bench/train.py's cells
            torch.set_num_threads(1)
        self.out, self.copy_to, self.models_dir = out, copy_to, models_dir
        self.folders: dict[str, str] = {}
        self._batch: PackedBatch | None = None
        self._jobs: list[PathJob] | None = None
        self._workdir = tempfile.mkdtemp(prefix="gyre-gpu-")
        self.report: dict[str, Any] = {
            "benchmark": "gpu_check",
            "device": self.device.type,
            "fallback": None
            if self.cuda
            else "no CUDA device: tiny preset, tiny sizes (a test of the script)",
            "quick": quick,
            "budget_s": budget_s,
            "plan": dataclasses.asdict(self.plan),
            "environment": environment(self.device),
            "models": {},
            "sections": {},
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        self.report["wall_s"] = round(time.monotonic() - self.started, 2)
        os.makedirs(os.path.dirname(self.out) or ".", exist_ok=True)
        text = json.dumps(self.report, indent=1, default=str)
        tmp = f"{self.out}.tmp"
        with open(tmp, "w") as handle:
            handle.write(text)
        os.replace(tmp, self.out)
        if self.copy_to:
            with contextlib.suppress(OSError):
                os.makedirs(self.copy_to, exist_ok=True)
                shutil.copyfile(self.out, os.path.join(self.copy_to, "gpu.json"))

    def close(self) -> None:
        shutil.rmtree(self._workdir, ignore_errors=True)

    # models: built once per preset into models_dir and reused by later runs (a rerun skips the build)
    def build_models(self) -> None:
        from engines.model.build import save_model_folder
        from engines.model.config import ModelConfig

        for preset in self.plan.presets(self.selected):
            folder = os.path.join(self.models_dir, f"{preset}-seed0-{_model_key(preset)}")
            entry: dict[str, Any] = {"folder": folder}
            started = time.perf_counter()
            try:
                if os.path.exists(os.path.join(folder, "config.json")):
                    entry["reused"] = True
                else:
                    tmp = f"{folder}.tmp-{os.getpid()}"
                    parameters, vocab = save_model_folder(ModelConfig(preset=preset, seed=0), tmp)
                    os.replace(tmp, folder)
                    entry.update(reused=False, parameters=parameters, vocab_size=vocab)
                self.folders[preset] = folder
            except Exception:
                entry["error"] = _tail(traceback.format_exc())
            entry["build_s"] = round(time.perf_counter() - started, 2)
            self.report["models"][preset] = entry
            self.write()

    def folder(self, preset: str) -> str:
        if preset not in self.folders:
            raise RuntimeError(f"model {preset} was not built: {self.report['models'].get(preset)}")
        return self.folders[preset]

    def load(self, preset: str, dtype: str | None = None, device=None) -> torch.nn.Module:
        return _load(self.folder(preset), dtype or self.plan.dtype, device or self.device)

    def batch(self) -> PackedBatch:
        """bench/train.py's packed branched batch (token ids < 4096: valid for every preset)."""
        if self._batch is None:
            self._batch, naive = workload(os.path.join(self._workdir, "data"), 4096, self.plan.train_size)
            if self.plan.train_sequences is not None:  # a smaller batch: its counts follow
                kept = self._batch.sequences = self._batch.sequences[: self.plan.train_sequences]
                self._batch.n_tokens = sum(len(s) for s in kept)
                self._batch.n_target_tokens = int(sum(s.loss_mask.sum() for s in kept))
            self.report["batch"] = {
                "sequences": [len(s) for s in self._batch.sequences],
                "executions": len(self._batch.advantages),
                "tokens": self._batch.n_tokens,
                "targets": self._batch.n_target_tokens,
                "selected_trajectory_tokens": naive,
            }
        return self._batch

    def jobs(self) -> list[PathJob]:
        if self._jobs is None:
            self._jobs = per_path_jobs(self.batch().sequences)
        return self._jobs

    # sections
    def section(self, name: str, fn: Callable[[Run, dict, float], None]) -> None:
        sections = self.report["sections"]
        left = self.left()
        need = self.plan.min_s[name]
        if left < need:
            sections[name] = {
                "status": "skipped",
                "reason": f"budget: {left:.0f} s left, the section needs ~{need} s",
            }
            self.write()
            return
        later = [s for s in SECTIONS[SECTIONS.index(name) :] if s in self.selected]
        share = self.plan.shares[name] / sum(self.plan.shares[s] for s in later)
        section_deadline = time.monotonic() + max(need, left * share)
        figures: dict[str, Any] = {"status": "running"}
        sections[name] = figures
        self.write()
        started = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            fn(self, figures, section_deadline)
            errors = figures.get("errors") or {}
            if errors and not figures.get(MEASURED[name]):
                figures["status"], figures["error"] = "error", next(iter(errors.values()))
            else:
                figures["status"] = "partial" if errors or figures.get("skipped") else "ok"
        except Exception:
            figures["status"] = "error"
            figures["error"] = _tail(traceback.format_exc())
        figures["peak_gpu_gb"] = _peak_gb(self.device)
        figures["wall_s"] = round(time.perf_counter() - started, 2)
        _free(self.device)
        self.write()
        print(f"[gpu] {name}: {figures['status']} in {figures['wall_s']} s", flush=True)


def environment(device: torch.device) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: version(name) for name in ("transformers", "deepspeed", "pydantic", "duckdb", "pyarrow")},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    else:
        env["device_name"] = platform.processor() or "cpu"
    return env


# -- a. engine ----------------------------------------------------------------------------------------
def section_engine(run: Run, figures: dict, deadline: float) -> None:
    plan, device = run.plan, run.device
    figures["hf_mode"] = (
        "HF generate: one batched call per turn at the same batch size, left padding, the full context "
        "every turn (no prefix cache), greedy, exactly max_tokens new tokens (min_new_tokens)"
    )
    figures["runs"] = []
    models = {}
    for preset in plan.engine_presets:
        models[preset] = run.load(preset)
        _engine_workload(models[preset], 2, 1, 4, (16, 32), (8, 16), device, seed=99)  # warm-up
    for batch in plan.batch_sizes:
        for preset, model in models.items():
            if time.monotonic() > deadline:
                figures.setdefault("skipped", []).append(
                    f"{preset} batch {batch}: the section's time ran out"
                )
                continue
            result = _attempt(
                figures,
                f"{preset} batch {batch}",
                lambda model=model, batch=batch: _engine_workload(
                    model,
                    batch,
                    plan.turns,
                    plan.max_tokens,
                    plan.first_prompt_tokens,
                    plan.tool_tokens,
                    device,
                ),
            )
            if result is not None:
                for label, error in result.pop("errors", {}).items():
                    figures.setdefault("errors", {})[f"{preset} batch {batch} {label}"] = error
                figures["runs"].append({"preset": preset, **result})
            run.write()


def _engine_workload(
    model: torch.nn.Module,
    batch: int,
    turns: int,
    max_tokens: int,
    first_prompt_tokens: tuple[int, int],
    tool_tokens: tuple[int, int],
    device: torch.device,
    seed: int = 0,
) -> dict[str, Any]:
    longest = first_prompt_tokens[1] + turns * (max_tokens + tool_tokens[1]) + 8
    config = EngineConfig(
        max_batch_size=batch, max_model_len=longest, kv_budget_tokens=batch * longest, device=str(device)
    )
    engine = RolloutEngine(model, config)
    turns_seen, ours_s = agent_turns(
        engine, random.Random(seed + batch), batch, turns, max_tokens, first_prompt_tokens, tool_tokens
    )
    stats = engine.stats
    del engine
    generated = sum(len(o) for _, outputs in turns_seen for o in outputs)
    figures = {
        "batch": batch,
        "turns": turns,
        "calls": batch * turns,
        "prompt_tokens": sum(len(p) for prompts_, _ in turns_seen for p in prompts_),
        "generated_tokens": generated,
        "ours_s": round(ours_s, 3),
        "ours_tokens_per_s": round(generated / ours_s, 1),
        **cache_figures(stats),
    }
    hf = _attempt(figures, "hf_generate", lambda: _hf_generate(model, turns_seen, batch, max_tokens, device))
    if hf is not None:
        hf_s, agree, hf_prefilled = hf
        figures.update(
            hf_s=round(hf_s, 3),
            hf_tokens_per_s=round(generated / hf_s, 1),
            hf_prefilled_tokens_with_padding=hf_prefilled,
            speedup_vs_hf=round(hf_s / ours_s, 2),
            greedy_outputs_identical=f"{agree}/{batch * turns}",
        )
    return figures


def _hf_generate(model, turns_seen, batch: int, max_tokens: int, device) -> tuple[float, int, int]:
    """HF generate on the prompts our engine saw: (seconds, outputs identical to ours, prefilled tokens)."""
    pad = model.generation_config.pad_token_id or 0
    agree, hf_prefilled = 0, 0
    started = device_clock(device)
    with torch.inference_mode():
        for turn_prompts, ours in turns_seen:
            width = max(len(p) for p in turn_prompts)
            ids = torch.full((batch, width), pad, dtype=torch.long)
            mask = torch.zeros((batch, width), dtype=torch.long)
            for row, prompt in enumerate(turn_prompts):  # left padding
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            agree += sum(row == mine for row, mine in zip(out[:, width:].tolist(), ours, strict=True))
            hf_prefilled += batch * width
    return device_clock(device) - started, agree, hf_prefilled


# -- b. train -----------------------------------------------------------------------------------------
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
        model = _attempt(figures, f"{preset} load", lambda preset=preset: run.load(preset))
        if model is None:
            continue
        if not perturbed:
            near_policy_behaviour(batch.sequences, model)
            perturbed = True
        result = _attempt(figures, preset, lambda model=model: _throughput(run, model))
        if result is not None:
            figures["runs"].append({"preset": preset, "dtype": plan.dtype, **result})
        del model
        _free(device)
        run.write()
    if time.monotonic() > deadline:
        figures.setdefault("skipped", []).append("fp32 equality: the section's time ran out")
    else:
        equality = _attempt(figures, "fp32 equality", lambda: _equality(run, plan.train_presets[0]))
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


# -- c. deepspeed -------------------------------------------------------------------------------------
def section_deepspeed(run: Run, figures: dict, deadline: float) -> None:
    """In its own process, with a time limit: DeepSpeed's process group and hooks stay out of the other
    sections, a hung collective cannot eat their budget, and a failed NCCL start can be retried on gloo."""
    import torch.multiprocessing as mp

    plan, device = run.plan, run.device
    batch = run.batch()
    sequence = min(batch.sequences, key=len)
    context = mp.get_context("spawn")
    backends = [None, "gloo"] if device.type == "cuda" else [None]  # None: CoreTrainer's own choice
    for backend in backends:
        seconds = deadline - time.monotonic()
        if backend is not None and seconds < plan.min_s["deepspeed"]:
            figures.setdefault("skipped", []).append("the gloo retry: the section's time ran out")
            break
        answers = context.Queue()
        args = (run.folder(plan.deepspeed_preset), plan.deepspeed_steps, sequence, len(batch.advantages))
        process = context.Process(
            target=_deepspeed_process, args=(*args, backend, max(seconds, 10.0), answers), daemon=True
        )
        process.start()
        try:
            status, value = answers.get(timeout=max(seconds, 10.0) + 60)
        except Exception:  # queue.Empty: the limit passed without an answer
            status, value = "error", f"no answer within {max(seconds, 10.0) + 60:.0f} s (killed)"
        finally:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
        if status == "ok":
            figures.update(preset=plan.deepspeed_preset, **value)
            return
        figures.setdefault("errors", {})[backend or "default backend"] = value


def _deepspeed_process(
    folder: str, steps: int, sequence: PackedSequence, n_executions: int, backend, seconds: float, answers
) -> None:
    try:
        _quiet_transformers()
        answers.put(("ok", _deepspeed_steps(folder, steps, sequence, n_executions, backend, seconds)))
    except Exception:
        answers.put(("error", _tail(traceback.format_exc())))


def _deepspeed_steps(
    folder: str, steps: int, sequence: PackedSequence, n_executions: int, backend, seconds: float
) -> dict[str, Any]:
    """CoreTrainer (ZeRO-2, bf16): per step, its worker's micro-batch, apply, and the weight sync back."""
    import socket

    from engines.train.core import CoreTrainer

    deadline = time.monotonic() + seconds
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    if backend is not None:  # a process group made here; CoreTrainer then keeps it
        for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    started = time.perf_counter()
    model = _load(folder, "bfloat16", device)
    core = CoreTrainer(model, TrainerConfig(zero_stage=2, dtype="bfloat16"))
    figures: dict[str, Any] = {
        "zero_stage": 2,
        "dtype": "bfloat16",
        "micro_batch_tokens": len(sequence),
        "parameters": sum(p.numel() for p in core.params),
        "backend": torch.distributed.get_backend(),
        "engine_device": str(next(core.engine.module.parameters()).device),
        "worker_device": str(next(core.worker.model.parameters()).device),
        "init_s": round(time.perf_counter() - started, 2),
    }
    timings = []
    for step in range(steps + 1):  # the first one warms up and is reported apart
        if step and time.monotonic() > deadline:
            figures["skipped"] = [f"steps from {step} on: the section's time ran out"]
            break
        t0 = device_clock(device)
        core.worker.reset()
        core.worker.accumulate(sequence, n_executions, 0, core.version)
        t1 = device_clock(device)
        norm = core.apply(core.worker.grad)
        t2 = device_clock(device)
        core.sync_worker()
        t3 = device_clock(device)
        timings.append(
            {
                "micro_batch_s": t1 - t0,
                "apply_s": t2 - t1,
                "sync_worker_s": t3 - t2,
                "step_s": t3 - t0,
                "grad_norm": norm,
            }
        )
    figures["warmup_step"] = {k: round(v, 4) for k, v in timings[0].items()}
    timed = timings[1:] or timings
    for key in ("micro_batch_s", "apply_s", "sync_worker_s", "step_s"):
        figures[f"mean_{key}"] = round(statistics.mean(t[key] for t in timed), 4)
    figures["steps_timed"] = len(timings) - 1
    figures["version"] = core.version
    figures["peak_gpu_gb_in_process"] = _peak_gb(device)
    return figures


# -- d. role switch -----------------------------------------------------------------------------------
def section_role_switch(run: Run, figures: dict, deadline: float) -> None:
    plan, device = run.plan, run.device
    batch = run.batch()
    sequence = min(batch.sequences, key=len)
    n_executions = len(batch.advantages)
    rng = random.Random(5)
    engine_model = run.load(plan.switch_preset)
    context = [rng.randrange(engine_model.config.vocab_size) for _ in range(plan.switch_context)]
    engine = RolloutEngine(
        engine_model,
        EngineConfig(max_batch_size=4, max_model_len=plan.switch_context + 256, device=str(device)),
    )
    greedy = SamplingParams(temperature=0, max_tokens=16)
    first = engine.generate(
        [GenerateRequest(request_id="warm", session_id="s", prompt_ids=context, sampling=greedy)]
    )
    history = context + first[0].output_ids
    worker = GradWorker(run.load(plan.switch_preset, device="cpu"), LossConfig())  # the train cell, offloaded
    figures.update(
        preset=plan.switch_preset,
        session_context_tokens=len(history),
        micro_batch_tokens=len(sequence),
        trainer_offload="weights moved to host memory (pageable) between train phases",
        goals_s=GOALS_S,
        cycles=[],
    )
    for cycle in range(2):  # the first is cold (first transfers, kernels); the second is reported
        if cycle and time.monotonic() > deadline:
            figures.setdefault("skipped", []).append("warm cycle: the section's time ran out")
            break
        t0 = device_clock(device)
        engine.sleep()
        t1 = device_clock(device)
        worker.model.to(device)
        t2 = device_clock(device)
        worker.reset()
        worker.accumulate(sequence, n_executions, 0, cycle)
        t3 = device_clock(device)
        with torch.no_grad():  # the optimizer step (not timed): the trainer now holds NEW weights
            for param in worker.params:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-1e-3)
        version = cycle + 1
        u0 = device_clock(device)
        engine.wake(worker.model.state_dict(), version)
        u1 = device_clock(device)
        worker.model.zero_grad(set_to_none=True)
        worker.model.to("cpu")
        _free(device)
        u2 = device_clock(device)
        history = history + [rng.randrange(engine_model.config.vocab_size) for _ in range(8)]
        out = engine.generate(
            [
                GenerateRequest(
                    request_id=f"c{cycle}",
                    session_id="s",
                    prompt_ids=history,
                    sampling=SamplingParams(temperature=0, max_tokens=1),
                )
            ]
        )[0]
        u3 = device_clock(device)
        probe = next(iter(worker.model.state_dict()))
        fresh = torch.equal(engine.runner.model.state_dict()[probe].cpu(), worker.model.state_dict()[probe])
        history = history + out.output_ids
        figures["cycles"].append(
            {
                "rollout_to_train_s": round(t3 - t0, 4),
                "sleep_s": round(t1 - t0, 4),
                "trainer_to_device_s": round(t2 - t1, 4),
                "first_micro_batch_s": round(t3 - t2, 4),
                "train_to_rollout_s": round(u3 - u0, 4),
                "wake_s": round(u1 - u0, 4),
                "trainer_offload_s": round(u2 - u1, 4),
                "first_token_s": round(u3 - u2, 4),
                "first_token_prefilled_tokens": out.prefilled_tokens,
                "engine_has_new_weights": fresh,
                "token_policy_version": out.policy_versions[0],
            }
        )
        run.write()
    last = figures["cycles"][-1]
    figures["rollout_to_train_s"] = last["rollout_to_train_s"]
    figures["train_to_rollout_s"] = last["train_to_rollout_s"]
    figures["rollout_to_train_goal_met"] = last["rollout_to_train_s"] <= GOALS_S["rollout_to_train"]
    figures["train_to_rollout_goal_met"] = last["train_to_rollout_s"] <= GOALS_S["train_to_rollout"]
    del engine, engine_model, worker


# -- e. migration -------------------------------------------------------------------------------------
def _engine_process(name: str, folder: str, dtype: str, device: str, max_len: int, inbox, outbox) -> None:
    """An engine in its own process, driven by (command, args) messages; answers ("ok", result)."""
    try:
        _quiet_transformers()
        if device == "cpu":
            torch.set_num_threads(1)
        engine = RolloutEngine(
            _load(folder, dtype, device),
            EngineConfig(engine_id=name, device=device, max_model_len=max_len, kv_budget_tokens=8 * max_len),
        )
        dev = engine.runner.device
        transports: dict[str, Any] = {"shm": ShmTransport(), "ipc": TorchIpcTransport()}
        handles = {"shm": ShmHandle, "ipc": TorchIpcHandle}
        one = SamplingParams(temperature=0, max_tokens=1)

        def generate(session: str, context: list[int]) -> tuple[float, int]:
            started = device_clock(dev)
            out = engine.generate(
                [
                    GenerateRequest(
                        request_id=f"{session}-{time.monotonic_ns()}",
                        session_id=session,
                        prompt_ids=context,
                        sampling=one,
                    )
                ]
            )[0]
            return device_clock(dev) - started, out.prefilled_tokens

        def export(session: str, kind: str) -> tuple[dict, float, int]:
            started = device_clock(dev)
            state = engine.export_session(session)
            handle = transports[kind].send(state)
            return handle.model_dump(), device_clock(dev) - started, state.kv_bytes

        def import_(handle: dict, kind: str, session: str, context: list[int]) -> tuple[float, float, int]:
            started = device_clock(dev)
            engine.import_session(transports[kind].receive(handles[kind].model_validate(handle)))
            imported = device_clock(dev) - started
            seconds, prefilled = generate(session, context)  # the next call: only its last token runs
            return imported + seconds, imported, prefilled

        commands = {
            "generate": generate,
            "export": export,
            "import": import_,
            "end": engine.end_session,
            "release": transports["ipc"].release,
        }
        outbox.put(("ok", str(dev)))
        while True:
            command, args = inbox.get()
            if command == "stop":
                break
            try:
                outbox.put(("ok", commands[command](*args)))
            except Exception:
                outbox.put(("error", _tail(traceback.format_exc())))
    except Exception:
        outbox.put(("error", _tail(traceback.format_exc())))


class _Remote:
    """The driving side of one engine process."""

    def __init__(self, context, name: str, *args):
        self.inbox, self.outbox = context.Queue(), context.Queue()
        self.process = context.Process(
            target=_engine_process, args=(name, *args, self.inbox, self.outbox), daemon=True
        )
        self.process.start()

    def wait(self, timeout: float = 300) -> Any:
        status, value = self.outbox.get(timeout=timeout)
        if status != "ok":
            raise RuntimeError(f"engine process failed:\n{value}")
        return value

    def call(self, command: str, *args, timeout: float = 300) -> Any:
        self.inbox.put((command, args))
        return self.wait(timeout)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.inbox.put(("stop", ()))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)


def _move(a: _Remote, b: _Remote, kind: str, session: str, tokens: list[int]) -> tuple:
    """A session of ``tokens`` made on A, moved to B over ``kind``, continued there: the timings."""
    a.call("generate", session, tokens)
    started = time.perf_counter()
    handle, export_s, kv_bytes = a.call("export", session, kind)
    total_b, import_s, prefilled = b.call("import", handle, kind, session, tokens)
    relayed = time.perf_counter() - started
    return export_s + total_b, export_s, import_s, relayed, prefilled, kv_bytes


def section_migration(run: Run, figures: dict, deadline: float) -> None:
    import torch.multiprocessing as mp

    plan, device = run.plan, run.device
    longest = max(plan.migration_contexts) + 64
    context = mp.get_context("spawn")
    args = (run.folder(plan.migration_preset), plan.dtype, str(device), longest)
    a, b = _Remote(context, "engine-a", *args), _Remote(context, "engine-b", *args)
    transports = ["shm", "ipc"]
    figures.update(
        preset=plan.migration_preset,
        processes="two engine processes (torch.multiprocessing spawn) on the one device",
        transports={
            "shm": "ShmTransport: KV packed to host memory, one file in /dev/shm, mapped and copied to the device",
            "ipc": "TorchIpcTransport: KV packed into one device tensor shared by "
            + (
                "CUDA IPC (no host copy)"
                if device.type == "cuda"
                else "CPU shared memory (CUDA IPC needs a GPU: this exercises the same code path)"
            ),
        },
        runs=[],
    )
    if device.type != "cuda":
        figures["cuda_ipc"] = "skipped: no CUDA device (the torch IPC transport ran over CPU shared memory)"
    try:
        figures["devices"] = [a.wait(), b.wait()]
        rng = random.Random(3)
        vocab = 4096
        for n in plan.migration_contexts:
            samples: dict[str, list] = {"recompute": [], **{t: [] for t in transports}}
            for repeat in range(plan.migration_repeats + 1):  # the first round warms up and is dropped
                if repeat and time.monotonic() > deadline:
                    figures.setdefault("skipped", []).append(
                        f"{n} tokens, repeat {repeat}: the section's time ran out"
                    )
                    break
                tokens = [rng.randrange(vocab) for _ in range(n)]
                for kind in list(transports):
                    session = f"{kind}-{n}-{repeat}"
                    row = _attempt(
                        figures,
                        kind,
                        lambda kind=kind, session=session, tokens=tokens: _move(a, b, kind, session, tokens),
                    )
                    a.call("release", session)
                    a.call("end", session)
                    b.call("end", session)
                    if row is None:
                        transports.remove(kind)  # recorded under errors; the other transport goes on
                    elif repeat:
                        samples[kind].append(row)
                seconds, prefilled = b.call("generate", f"re-{n}-{repeat}", tokens)
                b.call("end", f"re-{n}-{repeat}")
                if repeat:
                    samples["recompute"].append((seconds, prefilled))
            if not samples["recompute"]:
                continue
            recompute_ms = statistics.median(s[0] for s in samples["recompute"]) * 1e3
            result: dict[str, Any] = {
                "context_tokens": n,
                "repeats": len(samples["recompute"]),
                "recompute_ms": round(recompute_ms, 3),
                "recompute_prefilled_tokens": samples["recompute"][0][1],
            }
            for kind, rows in samples.items():
                if kind == "recompute" or not rows:
                    continue
                total_ms = statistics.median(r[0] for r in rows) * 1e3
                result[kind] = {
                    "migrate_ms": round(total_ms, 3),
                    "export_send_ms": round(statistics.median(r[1] for r in rows) * 1e3, 3),
                    "receive_import_ms": round(statistics.median(r[2] for r in rows) * 1e3, 3),
                    "end_to_end_with_relay_ms": round(statistics.median(r[3] for r in rows) * 1e3, 3),
                    "prefilled_after_import": rows[0][4],
                    "kv_bytes": rows[0][5],
                    "recompute_over_migrate": round(recompute_ms / total_ms, 2),
                }
            figures["runs"].append(result)
            run.write()
        figures["migrate_ms_note"] = (
            "migrate = export + send on A, then receive + import + the next call's first token on B "
            "(device-synchronized, inside the processes); recompute = B prefills the same context and "
            "samples one token; end_to_end_with_relay adds the queue hops through the driver"
        )
    finally:
        a.stop()
        b.stop()


# -- entry ----------------------------------------------------------------------------------------------
SECTION_FUNCTIONS: dict[str, Callable[[Run, dict, float], None]] = {
    "engine": section_engine,
    "train": section_train,
    "deepspeed": section_deepspeed,
    "role_switch": section_role_switch,
    "migration": section_migration,
}


def summary(report: dict) -> list[str]:
    """The headline figures, one line each."""
    sections = report["sections"]
    lines = [
        f"device {report['environment'].get('device_name')} ({report['device']}), torch {report['environment']['torch']}, "
        f"wall {report.get('wall_s')} s of a {report['budget_s']} s budget"
    ]
    for name in SECTIONS:
        entry = sections.get(name, {"status": "not run"})
        error_lines = (entry.get("error") or "").strip().splitlines()
        why = entry.get("reason") or (error_lines[-1] if error_lines else "")
        if entry["status"] == "partial":
            why = "; ".join([*(f"error in {k}" for k in entry.get("errors", {})), *entry.get("skipped", [])])
        lines.append(f"{name:12s} {entry['status']}" + (f" ({why})" if why else ""))
        if name == "engine":
            for r in entry.get("runs", []):
                lines.append(
                    f"  {r['preset']:9s} batch {r['batch']:3d}: ours {r['ours_tokens_per_s']:9.1f} tok/s, "
                    f"HF {r['hf_tokens_per_s']:9.1f} tok/s ({r['speedup_vs_hf']}x), prefix hits {r['prefix_cache_hit_ratio']}"
                )
        elif name == "train":
            for r in entry.get("runs", []):
                lines.append(
                    f"  {r['preset']:9s} tree {r['tree_target_tokens_per_s']:9.1f} vs per-path "
                    f"{r['per_path_target_tokens_per_s']:9.1f} target tok/s ({r['tree_over_path_speedup']}x, "
                    f"limit {r['naive_over_unique_tokens']}x); GradWorker {r['grad_worker_over_tree']}x tree time"
                )
            if "equality_fp32" in entry:
                e = entry["equality_fp32"]
                lines.append(
                    f"  fp32 equality: max |logprob diff| {e['max_abs_logprob_diff']:.2e}, grad rel diff {e['grad_rel_diff']:.2e}"
                )
        elif name == "deepspeed" and "mean_step_s" in entry:
            lines.append(
                f"  {entry['preset']} ZeRO-2 bf16 ({entry['backend']}): step {entry['mean_step_s']} s = micro-batch "
                f"{entry['mean_micro_batch_s']} + apply {entry['mean_apply_s']} + sync {entry['mean_sync_worker_s']}; "
                f"peak {entry.get('peak_gpu_gb_in_process')} GB"
            )
        elif name == "role_switch" and "rollout_to_train_s" in entry:
            lines.append(
                f"  {entry['preset']}: rollout->train {entry['rollout_to_train_s']} s (goal 3 s: "
                f"{'met' if entry['rollout_to_train_goal_met'] else 'NOT met'}), train->rollout "
                f"{entry['train_to_rollout_s']} s (goal 1.5 s: {'met' if entry['train_to_rollout_goal_met'] else 'NOT met'})"
            )
        elif name == "migration":
            for r in entry.get("runs", []):
                moved = ", ".join(
                    f"{kind} {r[kind]['migrate_ms']} ms" for kind in ("shm", "ipc") if kind in r
                )
                lines.append(f"  {r['context_tokens']:5d} tokens: {moved}, recompute {r['recompute_ms']} ms")
    return lines


def main(
    out: str = DEFAULT_OUT,
    budget_s: float = 420.0,
    quick: bool = False,
    models_dir: str | None = None,
    sections: list[str] | None = None,
) -> dict[str, Any]:
    """Runs every section (or only ``sections``: a rerun of some) within ``budget_s``; writes ``out``
    (and $OUT/gpu.json when OUT is set). A rerun of some sections keeps the other sections' entries
    of an earlier ``out`` from the same kind of device, marked ``from_previous_run``."""
    unknown = set(sections or ()) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose among {', '.join(SECTIONS)}")
    selected = tuple(name for name in SECTIONS if sections is None or name in sections)
    previous = {}
    if sections is not None and os.path.exists(out):
        with open(out) as handle:
            previous = json.load(handle)
    _quiet_transformers()
    models_dir = models_dir or os.path.join(tempfile.gettempdir(), "gyre-gpu-models")
    run = Run(out, budget_s, quick, models_dir, os.environ.get("OUT"), selected)
    try:
        run.write()
        run.build_models()
        for name in SECTIONS:
            if name in selected:
                run.section(name, SECTION_FUNCTIONS[name])
            elif name in previous.get("sections", {}) and previous.get("device") == run.device.type:
                run.report["sections"][name] = {**previous["sections"][name], "from_previous_run": True}
            else:
                run.report["sections"][name] = {"status": "skipped", "reason": "not selected (--sections)"}
        run.report["summary"] = summary(run.report)
        run.write()
    finally:
        run.close()
    print("\n".join(run.report["summary"]))
    print(f"wrote {out}")
    return run.report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all sections together")
    parser.add_argument("--quick", action="store_true", help="fewer presets and sizes")
    parser.add_argument("--models-dir", default=None, help="where built model folders are kept (and reused)")
    parser.add_argument(
        "--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)} (a rerun of some)"
    )
    cli = parser.parse_args()
    main(cli.out, cli.budget, cli.quick, cli.models_dir, cli.sections.split(",") if cli.sections else None)
    sys.exit(0)
