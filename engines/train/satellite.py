"""A satellite: its share of one elastic step (``run_satellite``) and its process (join one running
step of the core, contribute, leave).

    python -m engines.train.satellite --host 127.0.0.1 --port 29500 --step 3 --model ./policy
    python -m engines.train.satellite --host 10.0.0.11 --port 29500 --step 3 --model ./policy \
        --address 10.0.0.12      # on another host: the address the core reaches this one by

The satellite builds its model from the HF-format folder once, pulls the step's weights from the
core's fast in-host path, or on another host from the step's share URL (version-checked either way),
and takes micro-batches as they arrive (reading each
chunk of the step from storage once) until the step is closed and none are left, or until it is
asked to leave (engines/train/elastic.py has the protocol, engines/train/stream.py the queue).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from engines.model.weights import load_model, read_weights, save_weights
from engines.train.config import LossConfig
from engines.train.elastic_protocol import ElasticConfig, Heartbeat, Idle, has, reduce_sums, stats_record
from engines.train.stream import ChunkCache, claimed, read_batch, read_state, step_store, try_claim
from engines.train.worker import GradWorker, StepStats
from trajectory_store.processor import PackedSequence

__all__ = ["main", "read_batch", "run_satellite", "satellite_main", "start_satellites"]


def _hand_over(
    store: dist.Store, sid: int, worker: GradWorker, stats: StepStats, meta: dict, wait_s: float
) -> None:
    """A leaving satellite's gradient sum goes to a file the core adds (fp64, so still exact)."""
    path = None
    if stats.micro_batches:
        path = f"{meta['handoff_dir'].rstrip('/')}/step{meta['step']}-satellite{sid}.grad.safetensors"
        save_weights({"grad": worker.grad}, path, meta["version"])  # a local path or the share URL
    store.set(f"left/{sid}", json.dumps({**stats_record(stats), "grad": path, "wait_s": wait_s}))


def pull_weights(meta: dict, address: str | None) -> tuple[dict[str, torch.Tensor], int | None, str]:
    """The step's weights, version-checked, and where they came from: the core's file when this
    satellite shares the core's host (``address`` None or the core's), else the step's share URL."""
    remote = address is not None and address != meta.get("core_address")
    source = meta.get("weights_url") if remote else meta["weights"]
    if source is None:
        raise ValueError(
            f"a satellite at {address} is on another host than the core ({meta.get('core_address')}), "
            "and the step has no share URL to read its weights from (open_step's share_url)"
        )
    weights, version = read_weights(source, expected_version=meta["version"])
    return weights, version, source


def run_satellite(
    host: str,
    port: int,
    step: int,
    worker: GradWorker,
    load_batch: Callable[[str], list[PackedSequence]],
    *,
    config: ElasticConfig | None = None,
    join_when: Callable[[dist.Store], bool] | None = None,
    die_after: int | None = None,
    pace_s: float = 0.0,
    ready: Callable[[], None] | None = None,
    leave: Callable[[], bool] | None = None,
    leave_after: int | None = None,
    joined: Callable[[dict], None] | None = None,
    holds_weights: bool = False,
) -> dict:
    """A satellite's share of one step. ``leave`` is asked between micro-batches and while idle:
    True hands the gradient sum over to the core and returns at once (the cell can serve rollouts).
    ``holds_weights``: ``worker`` computes on the step's weights already (a rank of the core: its
    DeepSpeed world keeps every rank's weights equal), so nothing is pulled.

    Test and benchmark hooks: ``join_when`` delays joining ("after half the micro-batches"),
    ``die_after`` ends the process abruptly after that many micro-batches, ``leave_after`` leaves
    after that many, ``pace_s`` slows each micro-batch down, ``ready`` is called once connected.
    ``joined`` is called with {sid, pull_s} once the weights are pulled and the core counts on this
    satellite (the end of a cell's switch to training: scheduler/cells.py times it)."""
    config = config or ElasticConfig()
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.join_timeout_s))
    store = step_store(client, step)
    if ready is not None:
        ready()
    meta = json.loads(store.get("meta"))
    while join_when is not None and not join_when(store):
        time.sleep(0.005)
    state = read_state(store)
    if state.closure is not None and claimed(store) >= state.total:
        return {"sid": None, "member": False, "late": True, "micro_batches": []}
    sid = store.add("joined", 1)
    heartbeat = Heartbeat(store, f"hb/{sid}", config.heartbeat_s)
    try:
        pulled = time.perf_counter()
        if holds_weights:
            version, source = meta["version"], "held"
            if worker.version != version:
                raise ValueError(f"this rank holds version {worker.version}; step {step} trains {version}")
        else:
            weights, version, source = pull_weights(meta, config.address)
            worker.load_weights(weights, version)
        pull_s = time.perf_counter() - pulled
        cache = ChunkCache(load_batch)
        worker.reset()
        stats = StepStats()
        waited, idle = 0.0, Idle(config)
        result = {"sid": sid, "pull_s": pull_s, "weights": source}
        store.set(f"active/{sid}", "1")  # from here on the core waits for this satellite
        if joined is not None:
            joined(dict(result))
        while True:
            if has(store, f"evicted/{sid}"):  # found dead by the core (a long stall): its work is redone
                return result | {"member": False, "evicted": True, "micro_batches": stats.micro_batches}
            if (leave is not None and leave()) or (
                leave_after is not None and len(stats.micro_batches) >= leave_after
            ):
                asked = time.perf_counter()
                _hand_over(store, sid, worker, stats, meta, waited)
                return result | {
                    "member": False,
                    "left": True,
                    "micro_batches": stats.micro_batches,
                    "handoff_s": time.perf_counter() - asked,
                    "left_after_s": time.time() - meta["opened_at"],
                    "wait_s": waited,
                }
            state = read_state(store)
            index = try_claim(store, sid, state.total)
            if index is None:
                if state.closure is not None:
                    break
                waited += idle.wait()
                continue
            idle.busy()
            store.set(f"owner/{index}", str(sid))
            stats.add(worker.accumulate(cache.sequence(state, index), meta["n_executions"], index, version))
            if die_after is not None and len(stats.micro_batches) >= die_after:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-step: a killed cell, at a known point
            if pace_s:
                time.sleep(pace_s)
        store.set(f"finished/{sid}", json.dumps({"micro_batches": stats.micro_batches, "wait_s": waited}))
        result |= {"micro_batches": stats.micro_batches, "wait_s": waited, "left": False}
        group = json.loads(store.get("group/0"))
        if sid not in group["members"]:
            return result | {"member": False}
        rank = group["members"].index(sid)
        reduce_sums(
            store, 0, rank, len(group["members"]), worker.grad, stats, config.reduce_timeout_s, config.address
        )
        return result | {"member": True}
    finally:
        heartbeat.stop()


def satellite_main(
    host: str,
    port: int,
    step: int,
    model_dir: str,
    loss: dict | None = None,
    *,
    join_after_claims: int = 0,
    die_after: int | None = None,
    leave_after: int | None = None,
    leave=None,
    threads: int = 1,
    pace_s: float = 0.0,
    ready=None,
    results=None,
    address: str | None = None,
) -> dict:
    """``leave``: an Event (e.g. multiprocessing's) whose setting makes the satellite leave after its
    current micro-batch; ``results``: a queue that receives the satellite's result dict."""
    torch.set_num_threads(threads)
    worker = GradWorker(load_model(model_dir, dtype=torch.float32), LossConfig(**(loss or {})))

    def join_when(store) -> bool:
        return claimed(store) >= join_after_claims

    result = run_satellite(
        host,
        port,
        step,
        worker,
        read_batch,
        config=ElasticConfig(address=address),
        join_when=join_when if join_after_claims else None,
        die_after=die_after,
        leave_after=leave_after,
        leave=leave.is_set if leave is not None else None,
        pace_s=pace_s,
        ready=ready.set if ready is not None else None,
    )
    if results is not None:
        results.put(result)
    return result


def start_satellites(host: str, port: int, model_dir: str, specs: list[dict], **common) -> list:
    """Spawned satellite processes of step 0 (one per ``specs`` entry: satellite_main's keyword
    arguments, with ``common`` ones), each started and connected before this returns (start-up is
    seconds on CPU)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready = [context.Event() for _ in specs]
    processes = [
        context.Process(
            target=satellite_main,
            args=(host, port, 0, model_dir),
            kwargs={"ready": event, **common, **spec},
            daemon=True,
        )
        for spec, event in zip(specs, ready, strict=True)
    ]
    for process in processes:
        process.start()
    for event in ready:
        if not event.wait(300):
            raise TimeoutError("a satellite did not connect within 300 s")
    return processes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument(
        "--model", required=True, help="HF-format policy folder (architecture and initial weights)"
    )
    parser.add_argument("--loss", default="{}", help="LossConfig as JSON")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--address",
        default=None,
        help="this host's address the core and the other satellites reach it by (the gloo reduction); "
        "default: torch's (GLOO_SOCKET_IFNAME, else what the host name resolves to)",
    )
    parser.add_argument(
        "--leave-after",
        type=int,
        default=None,
        help="leave after this many micro-batches (tests, benchmarks)",
    )
    args = parser.parse_args(argv)
    result = satellite_main(
        args.host,
        args.port,
        args.step,
        args.model,
        json.loads(args.loss),
        threads=args.threads,
        address=args.address,
        leave_after=args.leave_after,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
