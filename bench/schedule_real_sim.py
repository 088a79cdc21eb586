"""The simulator against bench/schedule_real.py's real runs: calibrated on some, predicting the others.

`sim_check` calibrates sim/calibrate.py's machine on the calibration runs (colocate and, where there
is one, async: CALIBRATION_STREAMING) and predicts every run of every policy; `what_if` predicts, on
that machine, where elastic would win with every execution trained at shares of the measured rate.
`python -m bench.schedule_real --measured FILE [--what-if ...]` runs both on saved runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from bench.schedule_real_work import CELLS, POLICIES
from scheduler.policy import make_policy
from sim.calibrate import MeasuredRun, calibrate, predict
from sim.presets import Preset

# The calibration's second run, async on the calibration problems: the update of a streaming step and
# the decode latency while training streams beside rollout (colocate's run: what its switches cost)
CALIBRATION_STREAMING = "calibration-async"


def sim_check(measured: dict[str, list[MeasuredRun]]) -> tuple[Preset, dict[str, dict[str, Any]]]:
    """The simulator calibrated on the calibration runs (colocate and, where the file has it, async,
    on problems no compared run has; never elastic) predicting every run of every policy: the
    calibrated machine, and per policy the mean real and simulated makespans and the worst round's
    error (`python -m bench.schedule_real --measured FILE` does it again on saved runs; a file from
    before 2026-12-05 has only the colocate calibration run, and calibrates on it alone)."""
    policy, params = POLICIES["async"]
    streaming = (
        (measured[CALIBRATION_STREAMING][0], make_policy(policy, **params), 2)
        if CALIBRATION_STREAMING in measured
        else None
    )
    machine = calibrate(
        measured["calibration"][0],
        make_policy("colocate"),
        CELLS,
        measured["calibration"][0].sessions_per_cell,
        streaming=streaming,
    )
    sim_vs_real = {}
    for label, (policy, params) in POLICIES.items():
        spans = [run.makespan_s for run in measured[label]]
        predicted = [
            predict(machine, run, make_policy(policy, **params), 1 if label == "colocate" else 2)
            for run in measured[label]
        ]
        errors = [abs(p - r) / r for p, r in zip(predicted, spans, strict=True)]
        sim_vs_real[label] = {
            "real_s": round(float(np.mean(spans)), 2),
            "sim_s": round(float(np.mean(predicted)), 2),
            "error": round(max(errors), 4),  # the worst round
            "rounds": [
                {"real_s": r, "sim_s": round(p, 2), "error": round(e, 4)}
                for p, r, e in zip(predicted, spans, errors, strict=True)
            ],
        }
        for p, r, e in zip(predicted, spans, errors, strict=True):
            print(f"sim {label:<12} predicted {p:7.1f} s  real {r:7.1f} s  error {e:.1%}")
    return machine, sim_vs_real


# The what-if's training rates, as shares of the rate the calibration measured
WHAT_IF_RATES = (1.0, 0.8, 0.7, 0.6, 0.5, 0.25)


def what_if(
    machine: Preset, measured: dict[str, list[MeasuredRun]], tokens_per_s: list[float]
) -> list[dict[str, Any]]:
    """Where elastic would win on this machine: the calibrated simulator (`machine`) on the elastic
    runs' own executions, every execution trained in full (as if every group had a signal: its
    unique tokens, its last context plus its last completion) at ``tokens_per_s`` per train cell,
    against the best static async split (1, 2 or 3 train cells) and colocate. A prediction, not a
    measurement: the real runs train one group of eight a step (the others carry no signal), which
    the core trains beside rollout in a few seconds, so a streaming async leaves elastic nothing."""
    policy, params = POLICIES["elastic"]
    rows = []
    for rate in tokens_per_s:
        heavy = dataclasses.replace(machine, trainer=dataclasses.replace(machine.trainer, tokens_per_s=rate))
        spans: dict[str, list[float]] = {}
        for run in measured["elastic"]:
            full = dataclasses.replace(
                run,
                executions=[
                    [
                        dataclasses.replace(
                            e, trained_tokens=float(e.context_tokens[-1] + e.output_tokens[-1])
                        )
                        for e in row
                    ]
                    for row in run.executions
                ],
            )
            spans.setdefault("colocate", []).append(predict(heavy, full, make_policy("colocate"), 1))
            for split in (1, 2, 3):
                asynchronous = make_policy("async", train_cells=split, max_policy_lag=1)
                spans.setdefault(f"async-{split}", []).append(predict(heavy, full, asynchronous, 2))
            spans.setdefault("elastic", []).append(predict(heavy, full, make_policy(policy, **params), 2))
            trained = float(np.mean([sum(e.trained_tokens for e in row) for row in full.executions]))
        mean = {label: float(np.mean(values)) for label, values in spans.items()}
        best = min((label for label in mean if label.startswith("async")), key=mean.__getitem__)
        row = {
            "train_tokens_per_s": rate,
            "trained_tokens_per_step": round(trained),
            "one_cell_train_s_per_step": round(trained / rate, 1),
            "makespan_s": {label: round(value, 1) for label, value in mean.items()},
            "best_async": best,
            "speedup_vs_async": round(mean[best] / mean["elastic"], 4),
            "speedup_vs_colocate": round(mean["colocate"] / mean["elastic"], 4),
        }
        print(
            f"what-if {rate:7.1f} tokens/s a cell ({row['one_cell_train_s_per_step']:6.1f} s a step on one cell): "
            + "  ".join(f"{label} {value:6.1f}" for label, value in row["makespan_s"].items())
            + f"  elastic {row['speedup_vs_async']:.3f}x {best}, {row['speedup_vs_colocate']:.3f}x colocate"
        )
        rows.append(row)
    return rows
