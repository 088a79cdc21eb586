"""A satellite cell's process: join one running step of the core, contribute, leave.

    python -m engines.train.satellite --host 127.0.0.1 --port 29500 --step 3 --model ./policy

The satellite builds its model from the HF-format folder once, pulls the step's weights from the
core's fast in-host path (version-checked), and takes micro-batches as they arrive (reading each
chunk of the step from storage once) until the step is closed and none are left, or until it is
asked to leave (engines/train/elastic.py has the protocol, engines/train/stream.py the queue).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from engines.model.weights import load_model
from engines.train.config import LossConfig
from engines.train.elastic import ElasticConfig, run_satellite
from engines.train.stream import claimed, read_batch
from engines.train.worker import GradWorker

__all__ = ["main", "read_batch", "satellite_main", "start_satellites"]


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
        config=ElasticConfig(),
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
    args = parser.parse_args(argv)
    result = satellite_main(
        args.host, args.port, args.step, args.model, json.loads(args.loss), threads=args.threads
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
