"""What a second sequence costs a cell's decode step: the simulator's batch cost, measured.

    python -m bench.batch_cost [--cores 0.4] [--out FILE]

The simulator prices a decode step at ``fixed + batch x per_seq`` (sim/presets.py `EngineModel`);
``batch_cost`` = per_seq / fixed. On a GPU a second sequence is almost free; on a CPU cell of a
fraction of a core it may cost nearly a whole step. This measures it where the hosts benchmark's
cells run: our engine (engines/rollout, the `tiny` preset, float32, one torch thread) in a process
born in a cgroup with the cell's quota (engines/devices/cpu_quota.py `cell_quota`), decoding one
sequence, then two at once, from 300-token prompts. Per batch size, the median step time over the
steps that decoded that many sequences (the prefills left out); t(b) = fixed + b x per_seq gives
per_seq = t(2) - t(1) and fixed = t(1) - per_seq. Where the machine refuses cgroups, the process runs
on the shared cores (``quota`` false).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 300
NEW_TOKENS = 96
ROUNDS = 3


def _child(model_dir: str) -> None:
    """In the cell's cgroup: step times of one and two sequences, printed as JSON."""
    from engines.devices.settings import enter_cell

    enter_cell()
    from engines.rollout.config import EngineConfig
    from engines.rollout.engine import RolloutEngine
    from engines.rollout.messages import GenerateRequest, SamplingParams

    engine = RolloutEngine(model_dir, EngineConfig(max_batch_size=8))
    times: dict[int, list[float]] = {1: [], 2: []}
    for round_ in range(ROUNDS + 1):  # the first round warms up, not counted
        for batch in (1, 2):
            for i in range(batch):
                prompt = [(7 * i + 13 * j + round_) % 200 + 10 for j in range(PROMPT_TOKENS)]
                sampling = SamplingParams(max_tokens=NEW_TOKENS, seed=i, stop_token_ids=[])
                engine.add_request(
                    GenerateRequest(request_id=f"r{round_}-{batch}-{i}", prompt_ids=prompt, sampling=sampling)
                )
            while engine.has_unfinished():
                decoding = len(engine.running)
                started = time.perf_counter()
                engine.step()
                if round_ and decoding == batch and not engine.waiting:
                    times[batch].append(time.perf_counter() - started)
    print(json.dumps({str(b): t for b, t in times.items()}))


def batch_cost(cores: float | None = 0.4) -> dict[str, Any]:
    """The decode step of one and two sequences in a cell of ``cores`` cores, and their ratio."""
    from engines.devices import CellDevices, process_env
    from engines.devices.cpu_quota import cell_quota
    from engines.model import ModelConfig, init_model

    with tempfile.TemporaryDirectory(prefix="gyre-batch-cost-") as tmp:
        init_model(ModelConfig(preset="tiny", seed=0), tmp)
        with cell_quota("batch-cost", cores) as quota:
            [cell] = quota.place([CellDevices(threads=1)], ["batch-cost"])
            env = {**os.environ, **process_env(cell)}
            out = subprocess.run(
                [sys.executable, "-m", "bench.batch_cost", "--child", tmp],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            partitioned = quota.partitioned
    times = {int(b): t for b, t in json.loads(out.splitlines()[-1]).items()}
    one, two = statistics.median(times[1]), statistics.median(times[2])
    per_seq = max(two - one, 0.0)
    fixed = max(one - per_seq, 1e-9)
    return {
        "cores": cores,
        "quota": partitioned,
        "step_s": {"1": round(one, 5), "2": round(two, 5)},
        "steps_timed": {"1": len(times[1]), "2": len(times[2])},
        "fixed_s": round(fixed, 5),
        "per_seq_s": round(per_seq, 5),
        "batch_cost": round(per_seq / fixed, 3),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2])
        sys.exit(0)
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=float, default=0.4, help="the cell's quota (0: the shared cores)")
    parser.add_argument("--out", default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    figures = batch_cost(args.cores or None)
    print(json.dumps(figures))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
