"""Beyond one machine, measured (issue 36): `gyre bench hosts [--quick]` writes bench/results/hosts.json.

    python -m bench.hosts [--quick] [--out FILE]

What it measures so far: a session's KV moved between two hosts over TCP against the importing
engine prefilling the same context again, at 8K and 32K tokens (quick: 8K). The exporting engine
serves the KV once over its own HTTP and the importing engine fetches it
(engines/rollout/migration.py `TcpTransport`; the gateway picks it for engines on different hosts).
The hosts are network namespaces the benchmark makes (bench/netns.py), one engine process in each,
one torch thread each; where the machine refuses namespaces, the two engines run on loopback ports
and `namespaces` is false.

Per size: the first engine prefills an N-token prompt in a session and samples one token (greedy);
then
- moved: the session's KV goes to the other engine (export + import, timed: `tcp_s`), which answers
  the next turn (the sampled token and one new token, 4 tokens out) from it (`moved_answer_s`);
- re-prefilled: the other engine answers the same next turn from scratch (`reprefill_answer_s`),
  as the gateway's fallback does when a KV cannot move (an engine dies, a transfer fails).
Both answers must be the same tokens (`same_answer`), and the moved one must have prefilled only
the turn's 2 new tokens. `speedup` = reprefill_answer_s / (tcp_s + moved_answer_s).

The model is the `tiny` preset (3M parameters, 4 layers, 2 KV heads of 64, float32: 4 KiB of KV a
token), generated locally, with its RoPE table set to 65,536 positions.

Training across hosts (`train`): one elastic step of the tiny preset on a synthetic branched batch
(bench/train.py's workload), three ways: the core alone; with one satellite on the core's host (it
reads the core's weights file); with one satellite on another host (a namespace: it reads the
step's weights and the batch from S3, a moto server on the hosts' network, and joins the gloo
reduction across the bridge). Per way: step time (from the batch's arrival, once the satellite has
joined, to the update), who trained which micro-batches, the satellite's weight pull, and the
update's difference from the core's alone; and the bytes that crossed between
the hosts for the remote satellite (the weights it read, its float64 gradient sum in the reduction).

The core across hosts (`core`): two steps of the trainer (`python -m engines.train.run`, the product's
trainer process) on that batch, with ZeRO 1, as one rank and as a DeepSpeed world of two ranks, the
second (`python -m engines.train.peer`) on another host; every rank reads the policy, the batch and
step 0's checkpoint (its own optimizer share) from S3. Per way: each step's time in the trainer (restore,
the update, the checkpoint of every share, the publish), the optimizer state each rank holds, the
update's difference from one rank's, and the bytes on the other host's link during the two steps.

Weight delivery (`train.weight_delivery`): three new versions sent to two engines as
`serve_version` sends them, the file to an engine on the core's host and the S3 URL to one on
another host; each engine's load-and-swap call, timed.

A campaign across hosts (`campaign`, bench/cluster.py): two steps of a small colocate campaign whose
three cells are flow runs on the hosts' work pools, on one host against three (the same two cores
either way: on this machine the hosts share them), and on three with h3 cut off during step 1: step
times, the bytes that crossed the hosts' links per step (their interface counters), when the host
was found lost and its cell served again elsewhere, and executions lost, recorded twice or trained
twice (goal 0).

The simulator beside it (`campaign.sim_prediction`, not with --quick): calibrated on the 1-host run
(sim/calibrate.py fits its decode latency so that it reproduces that run's steps), it predicts the
3-host run's steps from that run's executions, the weights reaching each host's cells over its own
link (sim/calibrate.py `on_hosts`), at the rate the weight delivery measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import s3fs
import torch

from bench.netns import TestHost, engine_on, hosts, root_address
from bench.servers import s3_server
from bench.train import workload
from engines.admin import ENGINE_STATS, EXPORT_SESSION, IMPORT_SESSION, AdminClient
from engines.model.build import save_model_folder
from engines.model.config import ModelConfig
from engines.model.weights import load_model, save_weights
from engines.net import free_port
from engines.train.config import CoreWorld, TrainerConfig
from engines.train.core import CoreTrainer
from engines.train.elastic import ElasticCoordinator
from engines.train.elastic_protocol import ElasticConfig
from engines.train.run import TrainStepRequest
from scheduler.policy import make_policy
from sim.calibrate import MeasuredRun, calibrate, link_pull_s, on_hosts, predict
from trajectory_store.processor import PackedBatch, batch_to_table

DEFAULT_OUT = "bench/results/hosts.json"
TOKEN = "bench-hosts-engine-token"
SIZES = (8192, 32768)
QUICK_SIZES = (8192,)
ROUNDS = 2  # every size measured this many times (quick: once); the medians are reported
POSITIONS = 65536


def bench_model(folder: str) -> str:
    """The tiny preset with a 65,536-position RoPE table (contexts of 32K tokens and more)."""
    save_model_folder(ModelConfig(preset="tiny", seed=0), folder)
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = POSITIONS
    config_path.write_text(json.dumps(config, indent=1))
    return folder


def _post(client: httpx.Client, url: str, body: dict, admin: bool = False) -> dict:
    headers = {"authorization": f"Bearer {TOKEN}"} if admin else {}
    answer = client.post(url, json=body, headers=headers)
    if answer.status_code != 200:
        raise RuntimeError(f"POST {url}: HTTP {answer.status_code} {answer.text[:300]}")
    return answer.json()


def _complete(
    client: httpx.Client, url: str, prompt: list[int], max_tokens: int, session: str | None
) -> dict:
    body: dict[str, Any] = {
        "model": "gyre-policy",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    body.update(return_token_ids=True, logprobs=1)
    if session is not None:
        body["session_id"] = session
    return _post(client, f"{url}/v1/completions", body)["choices"][0]


def _stats(client: httpx.Client, url: str) -> dict:
    answer = client.get(ENGINE_STATS.url(url), headers={"authorization": f"Bearer {TOKEN}"})
    answer.raise_for_status()
    return answer.json()


def kv_round(client: httpx.Client, a_url: str, b_url: str, tokens: int, seed: int) -> dict[str, Any]:
    """One measurement at ``tokens`` tokens of context (see the module's docstring)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(16, 4000) for _ in range(tokens)]
    session = f"s{tokens}-{seed}"
    first = _complete(client, a_url, prompt, 1, session)
    turn = prompt + first["token_ids"] + [rng.randrange(16, 4000)]
    before = _stats(client, b_url)
    started = time.perf_counter()
    handle = _post(client, EXPORT_SESSION.url(a_url), {"session_id": session, "transport": "tcp"}, admin=True)
    _post(client, IMPORT_SESSION.url(b_url), {"handle": handle}, admin=True)
    tcp_s = time.perf_counter() - started
    started = time.perf_counter()
    moved = _complete(client, b_url, turn, 4, session)
    moved_answer_s = time.perf_counter() - started
    after = _stats(client, b_url)
    started = time.perf_counter()
    fresh = _complete(client, b_url, turn, 4, None)
    reprefill_answer_s = time.perf_counter() - started
    return {
        "kv_bytes": handle["nbytes"],
        "tcp_s": tcp_s,
        "moved_answer_s": moved_answer_s,
        "reprefill_answer_s": reprefill_answer_s,
        "moved_prefilled_tokens": after["prefilled_tokens"] - before["prefilled_tokens"],
        "fetched_bytes": after["kv_bytes_fetched"] - before["kv_bytes_fetched"],
        "same_answer": moved["token_ids"] == fresh["token_ids"],
    }


def kv_migration(sizes: tuple[int, ...], rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gyre-bench-hosts-") as tmp:
        folder = bench_model(f"{tmp}/tiny-64k")
        with (
            hosts(["h1", "h2"]) as (h1, h2),
            engine_on(h1, folder, "A", TOKEN) as a_url,
            engine_on(h2, folder, "B", TOKEN) as b_url,
            httpx.Client(timeout=1800) as client,
        ):
            namespaces = h1.netns is not None
            rows = []
            for tokens in sizes:
                measured = [kv_round(client, a_url, b_url, tokens, seed) for seed in range(rounds)]
                tcp = statistics.median(m["tcp_s"] for m in measured)
                moved = statistics.median(m["moved_answer_s"] for m in measured)
                fresh = statistics.median(m["reprefill_answer_s"] for m in measured)
                row = {
                    "tokens": tokens,
                    "kv_bytes": measured[0]["kv_bytes"],
                    "tcp_s": round(tcp, 4),
                    "tcp_mb_per_s": round(measured[0]["kv_bytes"] / tcp / 1e6, 1),
                    "moved_answer_s": round(moved, 4),
                    "reprefill_answer_s": round(fresh, 3),
                    "speedup": round(fresh / (tcp + moved), 2),
                    "moved_prefilled_tokens": max(m["moved_prefilled_tokens"] for m in measured),
                    "fetched_bytes_match": all(m["fetched_bytes"] == m["kv_bytes"] for m in measured),
                    "same_answer": all(m["same_answer"] for m in measured),
                    "rounds": [
                        {k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()}
                        for m in measured
                    ],
                }
                print(
                    f"kv {tokens:6d} tokens  {row['kv_bytes'] / 2**20:7.1f} MiB  over tcp {row['tcp_s']:7.3f} s "
                    f"({row['tcp_mb_per_s']:7.1f} MB/s) + answer {row['moved_answer_s']:6.3f} s  "
                    f"re-prefill + answer {row['reprefill_answer_s']:8.2f} s  {row['speedup']:7.1f}x  "
                    f"same answer {row['same_answer']}  prefilled after the move {row['moved_prefilled_tokens']}",
                    flush=True,
                )
                rows.append(row)
    return {"hosts": 2, "namespaces": namespaces, "sizes": rows}


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
            f"{[round(b / 2**20, 2) for b in row['optimizer_state_bytes_by_rank']]} MiB  bytes on the other "
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
    }


CAMPAIGN_RUNS: dict[str, dict[str, Any]] = {
    "1_host": {"cells": [3]},
    "3_hosts": {"cells": [1, 1, 1]},
    "3_hosts_h3_cut": {"cells": [1, 1, 1], "cut": "h3"},
    "3_hosts_2_gateways_one_killed": {"cells": [1, 1, 1], "gateways": 2, "kill_gateway": True},
}
"""The campaign runs (bench/cluster.py): its three cells on one host, one on each of three hosts, the
same with h3 cut off during step 1, and with two gateways, one SIGKILLed during step 0 (quick: the
last two)."""


def campaign_across_hosts(quick: bool = False, delivery: dict[str, Any] | None = None) -> dict[str, Any]:
    """The campaign of bench/cluster.py on 1 host and on 3 (the same three cells, the same two cores),
    and on 3 with one cut off mid-step: step times, bytes on the hosts' links, recovery, and what was
    lost or counted twice; with ``delivery`` (train.weight_delivery's figures), the simulator's
    prediction of the 3-host steps beside their measurement (`sim_prediction`)."""
    from bench.cluster import campaign_on_hosts

    runs, measured = {}, {}
    for name, run in CAMPAIGN_RUNS.items():
        cut = run.get("cut")
        if quick and cut is None and not run.get("kill_gateway"):
            continue
        with tempfile.TemporaryDirectory(prefix=f"gyre-bench-hosts-{name}-") as tmp:
            row = campaign_on_hosts(Path(tmp), **run)
        row.pop("cell_runs")
        measured[name] = row.pop("measured")
        runs[name] = row
        print(
            f"campaign    {name:<15} steps {row['step_s']} s  bytes on host links a step "
            f"{row['bytes_between_hosts_per_step'] / 2**20:6.1f} MiB  executions {row['executions']}  lost "
            f"{row['executions_lost']}  trained twice {row['trained_twice']}  calls recorded twice "
            f"{row['calls_recorded_twice']}"
            + (
                f"  cut {row['cut']}: found lost {row['found_lost_s']} s, serving again {row['recovery_s']} s "
                f"(moved {row['moved']})"
                if cut
                else ""
            )
            + (
                f"  gateway killed after {row['gateway_calls_before_kill']} calls: serving again "
                f"{row['gateway_serving_again_s']} s, executions that went on at their standby "
                f"{row['executions_went_on_at_standby']}"
                if run.get("kill_gateway")
                else ""
            ),
            flush=True,
        )
    cut_run = runs["3_hosts_h3_cut"]
    figures: dict[str, Any] = {
        "runs": runs,
        "hosts": cut_run["hosts"],
        "executions_lost": cut_run["executions_lost"],
        "trained_twice": cut_run["trained_twice"],
        "recovery_s": cut_run["recovery_s"],
        "bytes_between_hosts_per_step": cut_run["bytes_between_hosts_per_step"],
    }
    killed = runs["3_hosts_2_gateways_one_killed"]
    figures["gateway_killed"] = {
        k: killed[k]
        for k in (
            "gateways",
            "gateway_calls_before_kill",
            "gateway_serving_again_s",
            "executions_went_on_at_standby",
            "executions_lost",
            "calls_recorded_twice",
            "trained_twice",
        )
    }
    if "1_host" in runs:
        figures["step_s_1_host"] = runs["1_host"]["step_s_mean"]
        figures["step_s_3_hosts"] = runs["3_hosts"]["step_s_mean"]
        figures["bytes_between_hosts_per_step"] = runs["3_hosts"]["bytes_between_hosts_per_step"]
        if delivery is not None:
            figures["sim_prediction"] = sim_prediction(measured["1_host"], measured["3_hosts"], delivery)
    return figures


def sim_prediction(one: MeasuredRun, three: MeasuredRun, delivery: dict[str, Any]) -> dict[str, Any]:
    """The simulator calibrated on the 1-host run (sim/calibrate.py: its decode latency fitted so that
    it reproduces that run's steps) predicting the 3-host run's steps from their executions: the same
    three cells on the same cores, the weights reaching each host's cells over its one link (at the
    rate one delivery to an engine on another host measured: its read from S3, load and swap)."""
    cells = sum(CAMPAIGN_RUNS["1_host"]["cells"])
    weight_bytes, rate = delivery["bytes"], delivery["bytes"] / delivery["other_host_s"]
    one = dataclasses.replace(one, to_rollout_s=link_pull_s(cells, 1, weight_bytes, rate))
    three = dataclasses.replace(three, to_rollout_s=link_pull_s(cells, 3, weight_bytes, rate))
    machine = calibrate(one, make_policy("colocate"), cells, one.sessions_per_cell)
    steps = len(three.executions)
    predicted = (
        predict(on_hosts(machine, 3, 1, weight_bytes, rate), three, make_policy("colocate"), 1) / steps
    )
    fitted = predict(machine, one, make_policy("colocate"), 1) / len(one.executions)
    measured = three.makespan_s / steps
    figures = {
        "calibrated_on": "1_host",
        "link_bytes_per_s": round(rate),
        "weight_pull_s": {"1_host": round(one.to_rollout_s, 3), "3_hosts": round(three.to_rollout_s, 3)},
        "step_s_1_host_fitted": round(fitted, 2),
        "step_s_1_host_measured": round(one.makespan_s / len(one.executions), 2),
        "step_s_3_hosts_predicted": round(predicted, 2),
        "step_s_3_hosts_measured": round(measured, 2),
        "error": round(abs(predicted - measured) / measured, 4),
    }
    print(
        f"sim         3 hosts predicted {predicted:6.2f} s a step  measured {measured:6.2f} s  error "
        f"{figures['error']:.1%}  (calibrated on 1 host: fitted {fitted:.2f} s, measured "
        f"{figures['step_s_1_host_measured']:.2f} s)",
        flush=True,
    )
    return figures


def main(quick: bool = False, out: str = DEFAULT_OUT) -> int:
    started = time.perf_counter()
    sizes, rounds = (QUICK_SIZES, 1) if quick else (SIZES, ROUNDS)
    report: dict[str, Any] = {"quick": quick, "kv_migration": kv_migration(sizes, rounds)}
    report["train"] = train_across_hosts()
    report["core"] = core_across_hosts()
    report["campaign"] = campaign_across_hosts(quick, report["train"]["weight_delivery"])
    report["wall_s"] = round(time.perf_counter() - started, 1)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} ({report['wall_s']} s)")
    bad = [
        r["tokens"]
        for r in report["kv_migration"]["sizes"]
        if not (r["same_answer"] and r["fetched_bytes_match"])
    ]
    if bad:
        print(
            f"the moved session answered differently (or its bytes fell short) at {bad} tokens",
            file=sys.stderr,
        )
        return 1
    places = report["train"]["places"]
    if any(places[p]["update_rel_diff_vs_alone"] > 1e-4 for p in SATELLITE_PLACES[1:]):
        print("a step with a satellite made another update than the core alone", file=sys.stderr)
        return 1
    if report["core"]["update_rel_diff_2_ranks_vs_1"] > 1e-4:
        print("the core of two ranks made another update than the core of one", file=sys.stderr)
        return 1
    campaign = report["campaign"]
    if campaign["executions_lost"] or campaign["trained_twice"]:
        print("the campaign with a host cut off lost executions or trained one twice", file=sys.stderr)
        return 1
    killed = campaign["gateway_killed"]
    if killed["executions_lost"] or killed["trained_twice"] or killed["calls_recorded_twice"]:
        print("the campaign with a gateway killed lost, or counted twice, what it recorded", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8K tokens only, one round; the campaign only with a host cut off",
    )
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    sys.exit(main(args.quick, args.out))
