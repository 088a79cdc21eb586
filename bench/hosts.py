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

The scheduler's policies across hosts (`elastic`, bench/hosts_schedule.py; not with --quick):
colocate, async and elastic under the scheduler service on three hosts, their cells' replicas on
the hosts, two rounds, on a long-tailed workload; elastic with h3 cut off; and the simulator
calibrated on one host predicting each row.

Pieces: bench/hosts_kv.py (`kv_migration`), bench/hosts_train.py (`train`, with the weight delivery),
bench/hosts_core.py (`core`), bench/hosts_campaign.py (`campaign`, with `sim_prediction`),
bench/hosts_schedule.py (`elastic`); this
module runs them in turn, writes the figures and checks them. `sim_prediction` is imported here
again (``import X as X``) for tests/test_sim_hosts.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.hosts_campaign import campaign_across_hosts
from bench.hosts_campaign import sim_prediction as sim_prediction
from bench.hosts_core import core_across_hosts
from bench.hosts_kv import kv_migration
from bench.hosts_schedule import schedules_across_hosts
from bench.hosts_train import SATELLITE_PLACES, train_across_hosts

DEFAULT_OUT = "bench/results/hosts.json"
SIZES = (8192, 32768)
QUICK_SIZES = (8192,)
ROUNDS = 2  # every size measured this many times (quick: once); the medians are reported


def main(quick: bool = False, out: str = DEFAULT_OUT) -> int:
    started = time.perf_counter()
    sizes, rounds = (QUICK_SIZES, 1) if quick else (SIZES, ROUNDS)
    report: dict[str, Any] = {"quick": quick, "kv_migration": kv_migration(sizes, rounds)}
    report["train"] = train_across_hosts()
    report["core"] = core_across_hosts()
    report["campaign"] = campaign_across_hosts(quick, report["train"]["weight_delivery"])
    if not quick:
        report["elastic"] = schedules_across_hosts(delivery=report["train"]["weight_delivery"])
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
    cut = report.get("elastic", {}).get("cut", {})
    if cut.get("executions_lost") or cut.get("trained_twice") or cut.get("calls_recorded_twice"):
        print(
            "the elastic campaign with a host cut off lost or counted twice what it recorded", file=sys.stderr
        )
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
