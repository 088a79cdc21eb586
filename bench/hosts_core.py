"""The core trainer across hosts: `gyre bench hosts`' `core` section.

bench/hosts.py's docstring says what is measured. `core_across_hosts` runs two steps of the product's
trainer (``python -m engines.train.run``) with ZeRO 1 as one rank and as two, the second rank
(``python -m engines.train.peer``) on another host; `_core_request` is a step's request, `_core_step`
starts its processes and reads their reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import pyarrow.parquet as pq
import s3fs

from bench.hosts_train import TRAIN_SIZE
from bench.netns import TestHost, hosts, root_address
from bench.servers import s3_server
from bench.train import workload
from engines.model.build import save_model_folder
from engines.model.config import ModelConfig
from engines.model.weights import load_model
from engines.net import free_port
from engines.train.config import CoreWorld, TrainerConfig
from engines.train.run import TrainStepRequest
from trajectory_store.processor import PackedBatch, batch_to_table

CORE_TRAINER = TrainerConfig(lr=1e-5, zero_stage=1)


def core_across_hosts(size: dict[str, Any] = TRAIN_SIZE) -> dict[str, Any]:
    """Two trainer steps as one rank, and as two ranks with the second on another host (see the
    module's docstring)."""
    from bench.cluster import link_bytes

    with tempfile.TemporaryDirectory(prefix="gyre-bench-hosts-core-") as tmp, hosts(["h1"]) as (h1,):
        model_dir = f"{tmp}/tiny"
        _, vocab = save_model_folder(ModelConfig(preset="tiny", seed=0), model_dir)
        batch, _ = workload(f"{tmp}/data", vocab, size)
        pq.write_table(batch_to_table(batch, 0), f"{tmp}/batch.parquet")
        initial = load_model(model_dir, dtype="float32").state_dict()
        with s3_server(root_address(h1)) as (bucket, _):
            fs = s3fs.S3FileSystem()
            fs.put(f"{model_dir}/", f"{bucket}/policy/start/", recursive=True)
            fs.put_file(f"{tmp}/batch.parquet", f"{bucket}/batch.parquet")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            rows, weights = {}, {}
            for ranks in (1, 2):
                before = link_bytes(h1)
                steps = []
                for step in (0, 1):
                    request = _core_request(f"s3://{bucket}", f"{tmp}/fast-{ranks}", ranks, step, batch, h1)
                    steps.append(_core_step(request, h1, env))
                weights[ranks] = load_model(steps[-1]["checkpoint_url"] + "/hf", dtype="float32").state_dict()
                rows[f"{ranks}_rank" + ("s" if ranks > 1 else "")] = {
                    "step_s": [s["seconds"] for s in steps],
                    "optimizer_state_bytes_by_rank": steps[-1]["optimizer_state_bytes_by_rank"],
                    "micro_batches_by_rank": [s["micro_batches_by_rank"] for s in steps],
                    "other_host_link_bytes": link_bytes(h1) - before,
                }
    num = sum(float((weights[2][k] - weights[1][k]).double().pow(2).sum()) for k in weights[1])
    den = sum(float((weights[1][k] - initial[k]).double().pow(2).sum()) for k in weights[1])
    figures = {
        "namespaces": h1.netns is not None,
        "zero_stage": CORE_TRAINER.zero_stage,
        "parameters": sum(t.numel() for t in initial.values()),
        **rows,
        "update_rel_diff_2_ranks_vs_1": float(f"{(num / den) ** 0.5:.3e}"),
    }
    for name, row in rows.items():
        print(
            f"core        {name:<8} steps {row['step_s']} s  optimizer state by rank "
            f"{[round(b / 2**20, 2) for b in row['optimizer_state_bytes_by_rank']]} MiB  micro-batches by "
            f"rank {row['micro_batches_by_rank']}  bytes on the other "
            f"host's link {row['other_host_link_bytes'] / 2**20:.1f} MiB",
            flush=True,
        )
    print(f"core        2 ranks' update vs 1 rank's: {figures['update_rel_diff_2_ranks_vs_1']}", flush=True)
    return figures


def _core_request(
    root: str, fast: str, ranks: int, step: int, batch: PackedBatch, other: TestHost
) -> TrainStepRequest:
    os.makedirs(fast, exist_ok=True)
    world = None
    if ranks > 1:
        world = CoreWorld(address=root_address(other), port=free_port(), size=ranks)
    return TrainStepRequest(
        step=step,
        init_model=f"{root}/policy/start",
        resume_from=None if step == 0 else f"{root}/core-{ranks}/ck{step - 1}",
        batch_uri=f"{root}/batch.parquet",
        n_executions=len(batch.advantages),
        checkpoint_url=f"{root}/core-{ranks}/ck{step}",
        policy_root=f"{root}/core-{ranks}",
        fast_dir=fast,
        trainer=CORE_TRAINER,
        core=world,
    )


def _core_step(request: TrainStepRequest, other: TestHost, env: dict[str, str]) -> dict[str, Any]:
    """The step's trainer (rank 0, here) and its other rank (on ``other``): rank 0's report with
    every rank's optimizer state."""
    processes = [[sys.executable, "-m", "engines.train.run"]]
    if request.core is not None:
        processes.append(
            other.command(
                [sys.executable, "-m", "engines.train.peer", "--rank", "1", "--address", other.address]
            )
        )
    running = []
    for argv in processes:
        with tempfile.TemporaryFile("w+") as stdin:  # one each: a shared one shares its offset too
            stdin.write(request.model_dump_json())
            stdin.seek(0)
            running.append(
                subprocess.Popen(
                    argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
                )
            )
    outputs = [process.communicate(timeout=600) for process in running]
    failed = [
        f"{p.args[-6:]} exited with {p.returncode}:\n{err[-2000:]}"
        for p, (_, err) in zip(running, outputs, strict=True)
        if p.returncode != 0
    ]
    if failed:
        raise RuntimeError("\n".join(failed))
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    trainer = reports[0]
    return {
        "seconds": round(trainer["seconds"], 3),
        "checkpoint_url": trainer["checkpoint_url"],
        "optimizer_state_bytes_by_rank": [r["optimizer_state_bytes"] for r in reports],
        # every rank computes: rank 0's own share of the step's micro-batches, then each peer's
        "micro_batches_by_rank": [int(trainer["metrics"].get("core_micro_batches", 0))]
        + [int(r["micro_batches"]) for r in reports[1:]],
    }
