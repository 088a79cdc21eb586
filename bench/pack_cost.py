"""What a group's pack costs as a campaign grows, on S3: the step's parts against the whole store.

    python -m bench.pack_cost [--steps 3] [--groups 2] [--out bench/results/pack_cost.json]

A moto S3 server on loopback holds a campaign's store. Each step records ``groups`` groups of 4
executions (5 calls each, 200 prompt and 40 output tokens a call), one flush per execution, as the
gateway flushes at each execution's end. After each step, one group of it is packed
(trajectory_store.step.step_batch) twice: on a connection whose views read every part of the
campaign where it lies (``connect(store)``, what every pack opened before 2026-12-08: the baseline)
and on one holding the step's parts in memory (``connect(store, steps=[n])``, what tasks/steps.py
`pack` opens now). Both must pack the same sequences. Printed and saved per step: each way's
seconds (connection and pack) and their ratio; read the ratios, the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.servers import s3_server
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect
from trajectory_store.recorder import Recorder
from trajectory_store.step import step_batch
from trajectory_store.storage import Store, StoreConfig

MEMBERS, CALLS, PROMPT, OUTPUT = 4, 5, 200, 40


def record_step(store: Store, step: int, groups: int, rng: np.random.Generator) -> None:
    recorder = Recorder(store, step)
    for group in range(groups):
        for member in range(MEMBERS):
            execution = f"s{step}-g{group}-m{member}"
            context = rng.integers(1, 1000, PROMPT).tolist()
            for _ in range(CALLS):
                output = rng.integers(1, 1000, OUTPUT).tolist()
                recorder.record_call(execution, "main", "main", context, output, [-0.5] * OUTPUT, step)
                context = context + output + [5, 6]
            recorder.record_execution(
                execution,
                "completed",
                reward=float(member % 2),
                group_id=f"s{step}-g{group}",
                problem_id=f"g{group}",
            )
            recorder.flush()


def timed_pack(store: Store, step: int, steps: list[int] | None) -> tuple[float, int]:
    started = time.perf_counter()
    con = connect(store, SelectionConfig(), steps=steps)
    batch, _ = step_batch(
        con,
        PackingConfig(),
        step,
        trained_version=step,
        max_policy_lag=0,
        skip_zero_signal=True,
        group=f"s{step}-g0",
    )
    con.close()
    return time.perf_counter() - started, batch.n_tokens


def run(steps: int, groups: int) -> dict[str, Any]:
    rows = []
    with s3_server() as (bucket, env):
        store = Store(StoreConfig(data_root=f"s3://{bucket}/runs", s3_endpoint_url=env["AWS_ENDPOINT_URL"]))
        rng = np.random.default_rng(0)
        for step in range(steps):
            record_step(store, step, groups, rng)
            whole_s, whole_tokens = timed_pack(store, step, None)
            step_s, step_tokens = timed_pack(store, step, [step])
            if whole_tokens != step_tokens:
                raise RuntimeError(
                    f"step {step}: the two connections packed {whole_tokens} and {step_tokens} tokens"
                )
            rows.append(
                {
                    "step": step,
                    "whole_store_s": round(whole_s, 2),
                    "step_parts_s": round(step_s, 2),
                    "ratio": round(whole_s / step_s, 2),
                    "tokens": step_tokens,
                }
            )
            print(
                f"pack_cost   step {step}  whole store {whole_s:6.2f} s  the step's parts {step_s:5.2f} s  "
                f"ratio {whole_s / step_s:5.2f}",
                flush=True,
            )
    return {"steps": steps, "groups_a_step": groups, "executions_a_step": groups * MEMBERS, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--out", default="bench/results/pack_cost.json")
    args = parser.parse_args()
    figures = run(args.steps, args.groups)
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
