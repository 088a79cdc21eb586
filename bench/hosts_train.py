"""Training across hosts: `gyre bench hosts`' `train` section, with its weight delivery.

bench/hosts.py's docstring says what is measured. `train_step` runs one elastic step of the tiny
preset with one satellite process (engines.train.satellite) on the core's host, on another host (a
network namespace of bench/netns.py, reading from S3 on the hosts' network), or none;
`weight_delivery` sends new versions to an engine on each host as `serve_version` does;
`train_across_hosts` runs the three ways and the delivery and compares the updates.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import pyarrow.parquet as pq
import s3fs
import torch

from bench.hosts_kv import TOKEN
from bench.netns import TestHost, engine_on, hosts, root_address
from bench.servers import s3_server
from bench.train import workload
from engines.admin import AdminClient
from engines.model.build import save_model_folder
from engines.model.config import ModelConfig
from engines.model.weights import load_model, save_weights
from engines.train.config import TrainerConfig
from engines.train.core import CoreTrainer
from engines.train.elastic import ElasticCoordinator
from engines.train.elastic_protocol import ElasticConfig
from trajectory_store.processor import PackedBatch, batch_to_table

TRAIN_SIZE = {
    "max_context": 2000,
    "max_turns": 14,
    "budget": 2048,
    "executions": 16,
}  # bench/train.py's shape
SATELLITE_PLACES = ("alone", "same_host", "other_host")


def _satellite(
    host: TestHost | None, core: str, port: int, model_dir: str, env: dict[str, str]
) -> subprocess.Popen:
    """A satellite process of step 0: on the core's host (``host`` None), or on ``host`` with its address."""
    command = [sys.executable, "-m", "engines.train.satellite", "--host", core, "--port", str(port)]
    command += ["--step", "0", "--model", model_dir]
    if host is not None:
        command = host.command([*command, "--address", host.address])
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)


def train_step(
    place: str,
    model_dir: str,
    batch: PackedBatch,
    batch_uri: str,
    host: TestHost,
    share: str | None,
    env: dict[str, str],
    pace_s: float = 0.0,
) -> dict[str, Any]:
    """One elastic step of ``batch`` with one satellite at ``place`` (or none: "alone"); its figures."""
    core_address = root_address(host) if place == "other_host" else "127.0.0.1"
    core = CoreTrainer(load_model(model_dir, dtype="float32"), TrainerConfig(lr=1e-5))
    config = ElasticConfig(address=core_address if place == "other_host" else None)
    coordinator = ElasticCoordinator(core, host=core_address, config=config)
    process = None
    try:
        if place != "alone":
            remote = host if place == "other_host" else None
            process = _satellite(remote, core_address, coordinator.port, model_dir, env)
        n_executions = len(batch.advantages)
        with tempfile.TemporaryDirectory(prefix="gyre-bench-hosts-fast-") as fast:
            opened = coordinator.open_step(0, weights_dir=fast, n_executions=n_executions, share_url=share)
            deadline = time.monotonic() + 300
            while process is not None and opened.store.add("joined", 0) < 1:  # the satellite is there
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"the {place} satellite did not join (exit code {process.poll()})")
                time.sleep(0.05)
            opened.append(batch_uri, n_executions, sequences=batch.sequences)
            opened.close(n_executions)
            report = opened.train(pace_s=pace_s)
        result = (
            {}
            if process is None
            else json.loads(process.communicate(timeout=120)[0].strip().splitlines()[-1])
        )
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        coordinator.close()
    return {
        # from the batch's arrival (appended and closed once the satellite had joined) to the update
        "step_s": round(report.timings["step"] - report.timings["closed_after"], 3),
        "timings": {k: round(v, 3) for k, v in report.timings.items()},
        "satellite": {k: v for k, v in result.items() if k != "micro_batches"},
        "members": report.members,
        "micro_batches_by_participant": {str(k): len(v) for k, v in report.by_participant.items()},
        "satellite_pull_s": None if not result else round(result["pull_s"], 3),
        "satellite_weights": result.get("weights"),
        "weights": core.weights(),
        "grad_elements": core.last_grad.numel(),
    }


DELIVERIES = 3  # versions delivered to each engine


def weight_delivery(
    model_dir: str,
    initial: dict[str, torch.Tensor],
    host: TestHost,
    share: str,
    fast: str,
    env: dict[str, str],
) -> dict[str, Any]:
    """New policy versions to two engines, as `serve_version` sends them: to one on the core's host
    its fast file, to one on another host the version's URL in object storage. The time of each
    engine's load-and-swap call (the engine reads, loads and swaps; calls held back meanwhile)."""
    local_host = TestHost("core", "127.0.0.1", None)
    generator = torch.Generator().manual_seed(0)
    versions = []
    for version in range(1, DELIVERIES + 1):
        state, seen = {}, set()
        for name, tensor in initial.items():  # a tied tensor (lm_head = embeddings) once, as saved
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                state[name] = tensor + 1e-3 * torch.randn(tensor.shape, generator=generator)
        path, url = f"{fast}/policy-v{version}.safetensors", f"{share}/v{version}/model.safetensors"
        save_weights(state, path, version)
        save_weights(state, url, version)
        versions.append((version, path, url))
    admin = AdminClient(engine_token=TOKEN, timeout_s=300)
    times: dict[str, list[float]] = {"same_host": [], "other_host": []}
    try:
        with (
            engine_on(local_host, model_dir, "near", TOKEN, env=env) as near,
            engine_on(host, model_dir, "far", TOKEN, env=env) as far,
        ):
            for version, path, url in versions:
                for place, engine, source in (("same_host", near, path), ("other_host", far, url)):
                    started = time.perf_counter()
                    loaded = admin.load_weights(engine, source, version)
                    times[place].append(time.perf_counter() - started)
                    if loaded.policy_version != version:
                        raise RuntimeError(f"{engine} serves version {loaded.policy_version}, not {version}")
    finally:
        admin.close()
    return {
        "bytes": os.path.getsize(versions[0][1]),
        "same_host_s": round(statistics.median(times["same_host"]), 3),
        "other_host_s": round(statistics.median(times["other_host"]), 3),
        "rounds": {place: [round(t, 3) for t in values] for place, values in times.items()},
    }


def train_across_hosts(size: dict[str, Any] = TRAIN_SIZE, pace_s: float = 0.0) -> dict[str, Any]:
    """A training step of the tiny preset alone, with a satellite on the core's host, and with one on
    another host (its weights from S3 on the hosts' network, the gloo reduction across the bridge)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the core, like each satellite, on one thread: a participant per core
    try:
        return _train_across_hosts(size, pace_s)
    finally:
        torch.set_num_threads(threads)


def _train_across_hosts(size: dict[str, Any], pace_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gyre-bench-hosts-train-") as tmp, hosts(["h1"]) as (h1,):
        model_dir = f"{tmp}/tiny"
        _, vocab = save_model_folder(ModelConfig(preset="tiny", seed=0), model_dir)
        batch, _ = workload(f"{tmp}/data", vocab, size)
        local_uri = f"{tmp}/batch.parquet"
        pq.write_table(batch_to_table(batch, 0), local_uri)
        with s3_server(root_address(h1)) as (
            bucket,
            _,
        ):  # the core's S3 environment, as the satellites have it
            fs = s3fs.S3FileSystem()
            fs.put_file(local_uri, f"{bucket}/run/step0/chunk0.parquet")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            rows = {}
            for place in SATELLITE_PLACES:
                remote = place == "other_host"
                uri = f"s3://{bucket}/run/step0/chunk0.parquet" if remote else local_uri
                share = f"s3://{bucket}/run/fast" if remote else None
                rows[place] = train_step(place, model_dir, batch, uri, h1, share, env, pace_s)
            weight_bytes = fs.size(f"{bucket}/run/fast/step0-v0.safetensors")
            initial = load_model(model_dir, dtype="float32").state_dict()
            delivery = weight_delivery(model_dir, initial, h1, f"s3://{bucket}/policy", f"{tmp}/fast", env)
    alone = rows["alone"].pop("weights")
    rows["alone"].pop("grad_elements")
    for place in SATELLITE_PLACES[1:]:
        weights = rows[place].pop("weights")
        num = sum(float((weights[k] - alone[k]).double().pow(2).sum()) for k in alone)
        den = sum(float((alone[k] - initial[k]).double().pow(2).sum()) for k in alone)
        rows[place]["update_rel_diff_vs_alone"] = float(f"{(num / den) ** 0.5:.3e}")
    grad_bytes = 8 * rows["other_host"].pop("grad_elements")  # float64 sums
    rows["same_host"].pop("grad_elements")
    figures = {
        "namespaces": h1.netns is not None,
        "micro_batches": len(batch.sequences),
        "trained_tokens": int(batch.n_target_tokens),
        "places": rows,
        # what crossed between the hosts for the remote satellite: the step's weights (from S3), its
        # share of the batch (from S3), and its gradient sum in the gloo all-reduce of two members
        "bytes_between_hosts": {"weights": int(weight_bytes), "gradient_sum": grad_bytes},
        "other_host_over_same_host_step": round(
            rows["other_host"]["step_s"] / rows["same_host"]["step_s"], 3
        ),
        "alone_over_other_host_step": round(rows["alone"]["step_s"] / rows["other_host"]["step_s"], 3),
        "weight_delivery": delivery,
    }
    print(
        f"weights     {delivery['bytes'] / 2**20:5.1f} MiB a version  to an engine on the core's host "
        f"(its file) {delivery['same_host_s']:.3f} s  to an engine on another host (from S3) "
        f"{delivery['other_host_s']:.3f} s  (medians of {DELIVERIES})",
        flush=True,
    )
    for place, row in rows.items():
        print(
            f"train step  {place:<10}  {row['step_s']:6.2f} s  micro-batches {row['micro_batches_by_participant']}  "
            f"weights pull {row['satellite_pull_s']} s  update vs alone {row.get('update_rel_diff_vs_alone', '-')}",
            flush=True,
        )
    return figures
