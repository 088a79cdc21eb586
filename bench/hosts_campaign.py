"""A campaign across hosts, and the simulator's prediction of it: `gyre bench hosts`' `campaign` section.

bench/hosts.py's docstring says what is measured. `campaign_across_hosts` runs bench/cluster.py's
campaign for each of CAMPAIGN_RUNS; `sim_prediction` calibrates the simulator (sim/calibrate.py) on the
1-host run and predicts the 3-host run's steps, with the weights reaching each host over its own link.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from scheduler.policy import make_policy
from sim.calibrate import MeasuredRun, calibrate, link_pull_s, on_hosts, predict

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
