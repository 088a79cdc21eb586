"""`python -m bench.launch`: what the harness zygote saves on the demo campaign's executions.

The shipped warm start rolls out the demo's kind of step (12 problems of its suites x 4, its harness
settings) against one engine and the gateway, alternately with the zygote's forks
(environments/zygote.py) and with a fresh ``python -m environments.harness`` per execution, on the
same problems (``--rounds`` of each, alternating, so the engine's warm prefix cache favours neither).
These executions are short (2-5 calls), so the launch is a large share of their cost; a workload
bound by deadlines (`gyre bench rollout`) gains much less.

    python -m bench.launch [--rounds 2] [--concurrency 4]

Figures (bench/results/launch.json): seconds per round, executions per minute each way, and
``zygote_speedup`` (fresh-interpreter time over zygote time, summed over the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import replace

from bench.figures import write_figures
from environments.dispatch import dispatch_missing
from flows.config import CampaignConfig
from stack.stack import local_stack
from tasks.campaign import problems_for
from trajectory_store.storage import StoreConfig

DEFAULT_OUT = "bench/results/launch.json"
SEED = 30000  # neither held-out (0), the warm start's demonstrations (1000+), training (5000+) nor validation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="configs/learn-sft-quick.toml", help="policy, problems and harness"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    config = CampaignConfig.from_toml(args.config)
    problems = problems_for(
        list(config.problems.suites), 12, SEED, config.problems.difficulty, config.problems.length
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="gyre-launch-") as root:
        store = StoreConfig(data_root=f"{root}/store", campaign="launch")
        with local_stack(config.policy, store, engines=1, dtype="float32", max_batch_size=8) as stack:
            for step, zygote in enumerate([True, False] * args.rounds):
                dispatch = replace(
                    config.dispatch,
                    group_size=4,
                    concurrency=args.concurrency,
                    harness_zygote=zygote,
                    step=step,
                    campaign="launch",
                    workspace_root=None,
                )
                started = time.perf_counter()
                outcomes, _ = asyncio.run(
                    dispatch_missing(problems, stack.gateway_url, stack.admin_token, store, dispatch)
                )
                seconds = time.perf_counter() - started
                rows.append(
                    {
                        "zygote": zygote,
                        "seconds": round(seconds, 2),
                        "executions": len(outcomes),
                        "completed": sum(o.status == "completed" for o in outcomes),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    forked = [r for r in rows if r["zygote"]]
    fresh = [r for r in rows if not r["zygote"]]

    def per_minute(chosen: list[dict]) -> float:
        return 60 * sum(r["executions"] for r in chosen) / sum(r["seconds"] for r in chosen)

    figures = {
        "config": args.config,
        "policy": config.policy,
        "problems": len(problems),
        "group_size": 4,
        "concurrency": args.concurrency,
        "rows": rows,
        "executions_per_minute_zygote": round(per_minute(forked), 2),
        "executions_per_minute_fresh_interpreter": round(per_minute(fresh), 2),
        "zygote_speedup": round(sum(r["seconds"] for r in fresh) / sum(r["seconds"] for r in forked), 3),
    }
    print(
        f"executions per minute: {figures['executions_per_minute_zygote']} with the zygote, "
        f"{figures['executions_per_minute_fresh_interpreter']} with a fresh interpreter each "
        f"({figures['zygote_speedup']}x)"
    )
    write_figures(figures, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
