"""A rank above 0 of a core of several (TrainStepRequest.core, a CoreWorld), for one step.

    python -m engines.train.peer --rank 1 --address 10.0.0.3 < request.json
        # the step's TrainStepRequest, the same one rank 0 (python -m engines.train.run) reads
        # -> {"rank", "step", "version", "updates", "micro_batches", "optimizer_state_bytes", "seconds"},
        #    the last stdout line

It restores the core as rank 0 does (the starting policy, or the previous step's checkpoint with this
rank's optimizer share, from object storage: nothing from rank 0's disk), joins the DeepSpeed world at
rank 0's rendezvous, and follows rank 0 until the step ends: it computes micro-batches of every
elastic step rank 0 invites it to (as a satellite that already holds the weights: its gradient sum
joins rank 0's reduction, engines/train/elastic.py), makes every update with the summed gradient
rank 0 sends, and writes its share of the checkpoint. If rank 0 dies, its next collective times out
(CoreWorld.timeout_s) and it exits with an error; a retried step starts every rank again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from engines.devices import settings as devices
from engines.train.elastic_protocol import ElasticConfig
from engines.train.run import TrainStepRequest, restore
from engines.train.satellite import read_batch, run_satellite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.train.peer", description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True, help="this process's rank (1 .. size - 1)")
    parser.add_argument(
        "--address",
        default=None,
        help="this host's address on the network the ranks share (default: rank 0's)",
    )
    args = parser.parse_args(argv)
    devices.enter_cell()
    request = TrainStepRequest.model_validate_json(sys.stdin.read())
    if request.core is None:
        parser.error("the request names no core of several ranks (its `core` is null)")
    if not 1 <= args.rank < request.core.size:
        parser.error(
            f"--rank {args.rank}: the core has ranks 0 .. {request.core.size - 1}, and 0 is the trainer"
        )
    started = time.perf_counter()
    world = request.core.model_copy(update={"rank": args.rank, "local_address": args.address})
    core = restore(request, world)
    if core.step != request.step:
        raise ValueError(f"the checkpoint {request.resume_from} is at step {core.step}, not {request.step}")
    computed: list[int] = []
    elastic = ElasticConfig(address=world.local_address)

    def join(host: str, port: int, step: int) -> None:
        result = run_satellite(host, port, step, core.worker, read_batch, config=elastic, holds_weights=True)
        computed.extend(result.get("micro_batches", []))

    updates = core.follow(join)
    report = {
        "rank": args.rank,
        "step": core.step,
        "version": core.version,
        "updates": updates,
        "micro_batches": len(computed),  # of the step's updates, computed on this rank
        "optimizer_state_bytes": core.optimizer_state_bytes(),
        "seconds": round(time.perf_counter() - started, 3),
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
