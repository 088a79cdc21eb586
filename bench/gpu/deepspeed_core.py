"""The deepspeed section: the core cell's CoreTrainer (ZeRO-2, bf16) in a process of its own:
its worker's micro-batch, apply (surrogate backward + optimizer step), the weight sync back."""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Any

import torch

from bench.engine_workload import device_clock
from bench.gpu.run import Run, peak_gb, quiet_transformers, tail
from engines.model.weights import load_model
from engines.train.config import TrainerConfig
from trajectory_store.processor import PackedSequence


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
        quiet_transformers()
        answers.put(("ok", _deepspeed_steps(folder, steps, sequence, n_executions, backend, seconds)))
    except Exception:
        answers.put(("error", tail(traceback.format_exc())))


def _deepspeed_steps(
    folder: str, steps: int, sequence: PackedSequence, n_executions: int, backend, seconds: float
) -> dict[str, Any]:
    """CoreTrainer (ZeRO-2, bf16): per step, its worker's micro-batch, apply, and the weight sync back."""
    from engines.net import free_port
    from engines.train.core import CoreTrainer

    deadline = time.monotonic() + seconds
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    if backend is not None:  # a process group made here; CoreTrainer then keeps it
        for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    started = time.perf_counter()
    model = load_model(folder, "bfloat16", device)
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
    figures["peak_gpu_gb_in_process"] = peak_gb(device)
    return figures
