"""One GPU-check run: its budget, the model folders it builds once per preset, the packed batch the
training sections share, and the JSON it rewrites after every step; plus the helpers sections use
to time, free memory and record a failed measurement without losing the others."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.gpu.plan import MEASURED, SECTIONS, make_plan
from bench.train import workload
from engines.model.weights import load_model
from engines.train.reference import PathJob, per_path_jobs
from trajectory_store.processor import PackedBatch


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def model_key(preset: str) -> str:
    """Names a built model folder by what makes it: the preset, engines/model's code, transformers."""
    import transformers

    import engines.model.build as build
    from engines.model.config import PRESETS

    digest = hashlib.sha256(f"{PRESETS[preset]!r}/{transformers.__version__}".encode())
    for path in sorted(Path(build.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def attempt(figures: dict, label: str, fn: Callable[[], Any]) -> Any:
    """fn(), or None with its traceback's tail under figures["errors"][label]: one failed measurement
    never hides the others of its section."""
    try:
        return fn()
    except Exception:
        figures.setdefault("errors", {})[label] = tail(traceback.format_exc(), 2000)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


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
            folder = os.path.join(self.models_dir, f"{preset}-seed0-{model_key(preset)}")
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
                entry["error"] = tail(traceback.format_exc())
            entry["build_s"] = round(time.perf_counter() - started, 2)
            self.report["models"][preset] = entry
            self.write()

    def folder(self, preset: str) -> str:
        if preset not in self.folders:
            raise RuntimeError(f"model {preset} was not built: {self.report['models'].get(preset)}")
        return self.folders[preset]

    def load(self, preset: str, dtype: str | None = None, device=None) -> torch.nn.Module:
        return load_model(self.folder(preset), dtype or self.plan.dtype, device or self.device)

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
            if figures["status"] == "skipped":  # the section said why it could not run (its "reason")
                pass
            elif errors and not figures.get(MEASURED[name]):
                figures["status"], figures["error"] = "error", next(iter(errors.values()))
            else:
                figures["status"] = "partial" if errors or figures.get("skipped") else "ok"
        except Exception:
            figures["status"] = "error"
            figures["error"] = tail(traceback.format_exc())
        figures["peak_gpu_gb"] = peak_gb(self.device)
        figures["wall_s"] = round(time.perf_counter() - started, 2)
        free(self.device)
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
