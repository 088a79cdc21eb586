"""How many full-precision copies of the policy the core trainer holds, measured on a live CoreTrainer.

    python -m bench.train_memory [--preset tiny] [--family qwen2] [--dtype float32] [--zero-stage N]

Builds a seeded random model of the preset, loads it as the campaign's trainer does (float32), builds
a CoreTrainer on it (DeepSpeed engine + the core's GradWorker), makes one optimizer update, then walks
every tensor alive in the process (``gc.get_objects()``), each storage counted once, and sorts the
bytes by what holds them: the parameters the engine trains, other parameter-sized weight copies (a
ZeRO master partition, a worker's copy of the model), the optimizer's state (AdamW's two moments),
gradients. The figure that matters is ``full_precision_weight_copies``: fp32 bytes of weights divided
by 4 x parameters (1.0: one full-precision copy). The process RSS before and after is printed too.
Figures go to bench/results/train_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _storages(tensors) -> dict[int, tuple[int, torch.dtype]]:
    """data_ptr -> (bytes, dtype) of the distinct storages of ``tensors``."""
    found = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            found[storage.data_ptr()] = (storage.nbytes(), tensor.dtype)
    return found


def _optimizer_state(core) -> list[torch.Tensor]:
    optimizer = core.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's wrappers keep the torch AdamW inside
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def census(core) -> dict[str, float]:
    """MB of every live tensor storage, by holder, and the full-precision weight copies."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some library objects warns of deprecations
        warnings.simplefilter("ignore")
        alive = _storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    params = list(core.engine.module.parameters())
    n = sum(p.numel() for p in params)
    trained = _storages(params)
    state = _storages(_optimizer_state(core))
    inner = getattr(core.optimizer, "optimizer", core.optimizer)
    optimized = [p for group in inner.param_groups for p in group["params"]]
    grads = _storages(
        [core.worker.grad, core.last_grad, *(p.grad for p in [*params, *optimized] if p.grad is not None)]
    )
    mb = 2**20
    by_holder = {"trained_parameters": 0, "optimizer_state": 0, "gradients": 0, "other_weight_copies": 0}
    fp32_weights = 0
    for ptr, (nbytes, dtype) in alive.items():
        if ptr in trained:
            holder = "trained_parameters"
        elif ptr in state:
            holder = "optimizer_state"
        elif ptr in grads:
            holder = "gradients"
        elif nbytes >= 64 * 1024:  # a weight copy: the ZeRO master partition, a worker's model
            holder = "other_weight_copies"
        else:
            continue  # small tensors (rotary tables, scalars)
        by_holder[holder] += nbytes
        if holder in ("trained_parameters", "other_weight_copies") and dtype == torch.float32:
            fp32_weights += nbytes
    figures = {f"{k}_mb": round(v / mb, 2) for k, v in by_holder.items()}
    figures["parameters"] = n
    figures["fp32_parameter_mb"] = round(4 * n / mb, 2)
    figures["full_precision_weight_copies"] = round(fp32_weights / (4 * n), 3)
    return figures


def measure(preset: str, family: str, dtype: str, zero_stage: int | None) -> dict:
    from engines.model import ModelConfig, init_model
    from engines.model.weights import load_model
    from engines.train.config import TrainerConfig
    from engines.train.core import CoreTrainer

    with tempfile.TemporaryDirectory() as tmp:
        init_model(ModelConfig(preset=preset, family=family, dtype="float32"), tmp, force=True)
        model = load_model(tmp, dtype="float32")
    gc.collect()
    before = rss_mb()
    options = {"dtype": dtype} | ({} if zero_stage is None else {"zero_stage": zero_stage})
    config = TrainerConfig(**options)
    core = CoreTrainer(model, config)
    del model
    built = rss_mb()
    core.apply(torch.zeros(sum(p.numel() for p in core.params)))  # AdamW's moments exist after a step
    figures = census(core)
    figures.update(
        preset=preset,
        family=family,
        dtype=dtype,
        zero_stage=config.zero_stage,
        rss_model_loaded_mb=round(before, 1),
        rss_core_built_mb=round(built, 1),
        rss_after_one_update_mb=round(rss_mb(), 1),
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", help="model shape (default tiny)")
    parser.add_argument("--family", default="qwen2", help="model family (default qwen2)")
    parser.add_argument("--dtype", default="float32", help="TrainerConfig.dtype (default float32)")
    parser.add_argument("--zero-stage", type=int, default=None, help="default: TrainerConfig's")
    parser.add_argument("--out", default="bench/results/train_memory.json", help="figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    figures = measure(args.preset, args.family, args.dtype, args.zero_stage)
    figures["seconds"] = round(time.time() - started, 1)
    for key, value in figures.items():
        print(f"{key:32} {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
