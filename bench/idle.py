"""What an idle training participant costs the machine while it waits for micro-batches.

`python -m bench.idle [--seconds 5]` opens a streaming step on a real TCPStore (30 chunks appended,
all claimed: nothing left to do), then loops as an idle participant does (read the stream's state,
try to claim, wait) for --seconds, once at a constant 10 ms wait (the trainer until 2026-12-03) and
once with the backoff the trainer uses now (engines/train/elastic_protocol.py ``Idle``: 10 ms doubling to
50 ms). Prints the CPU it took, as a share of one core (process CPU time over wall time: the TCPStore
server's thread is in the same process, as the core's is), and their ratio; writes them to --out (bench/results/idle.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from engines.train.elastic_protocol import ElasticConfig, Idle
from engines.train.stream import append_chunk, open_stream, read_state, step_store, try_claim


def idle_share(store: dist.Store, idle: Idle, seconds: float) -> float:
    cpu, wall = time.process_time(), time.monotonic()
    while time.monotonic() - wall < seconds:
        state = read_state(store)
        if try_claim(store, 0, state.total) is not None:
            idle.busy()
        idle.wait()
    return (time.process_time() - cpu) / (time.monotonic() - wall)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", default="bench/results/idle.json", help="where the figures go (JSON)")
    args = parser.parse_args(argv)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    store = step_store(server, 1)
    open_stream(store)
    for i in range(30):
        append_chunk(store, f"file:///nonexistent/chunk{i}.parquet", 2, 4, key=f"chunk{i}")
    while try_claim(store, 0, read_state(store).total) is not None:
        pass
    constant = idle_share(store, Idle(ElasticConfig(poll_s=0.01, idle_max_s=0.01)), args.seconds)
    backoff = idle_share(store, Idle(ElasticConfig()), args.seconds)
    print(f"idle participant, constant 10 ms wait      cpu {constant * 100:5.2f}% of a core")
    print(f"idle participant, 10 ms doubling to 50 ms   cpu {backoff * 100:5.2f}% of a core")
    print(f"backoff / constant                          {backoff / constant:.3f}")
    with open(args.out, "w") as handle:
        json.dump(
            {
                "seconds": args.seconds,
                "cpu_share_constant_10ms": round(constant, 4),
                "cpu_share_backoff": round(backoff, 4),
                "backoff_over_constant": round(backoff / constant, 3),
            },
            handle,
            indent=2,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
