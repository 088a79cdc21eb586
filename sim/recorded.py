"""Suites fitted on a campaign's recorded executions: what `gyre sim --suites-from CAMPAIGN` runs.

The store's executions and calls tables hold, per execution, every model call in order with its
prompt and output lengths and its start and end (t_start, t_end). `suites_from_executions` fits one
`Suite` per harness on them: turns (calls) lognormal, output tokens per turn, the tokens a turn adds
to the context besides its output (the next prompt's growth: tool results), and the tool gaps (from
one call's end to the next call's start, and from the last call to the execution's end) lognormal.
The caller reads the rows (cli/schedule.py queries the store; sim/ never imports it) and passes them
as `RecordedExecution`s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.presets import Suite


@dataclass(frozen=True)
class RecordedCall:
    prompt_len: int
    output_len: int
    t_start: float
    t_end: float


@dataclass(frozen=True)
class RecordedExecution:
    suite: str
    """The harness (or suite) the execution ran: executions are fitted per suite."""
    calls: list[RecordedCall]
    """Its model calls, in order."""
    ended_at: float | None = None
    """When it ended (the last tool gap runs to here); None: no gap after the last call."""


def _lognormal(values: list[float], floor: float) -> tuple[float, float]:
    """(median, sigma) of a lognormal fitted on `values` (each at least `floor`)."""
    logs = np.log(np.maximum(np.asarray(values, dtype=float), floor))
    return float(math.exp(logs.mean())), float(logs.std())


def suites_from_executions(executions: list[RecordedExecution]) -> tuple[Suite, ...]:
    """One `Suite` per suite name, weighted by its share of the executions (those with no call
    are left out: nothing was decoded)."""
    by_suite: dict[str, list[RecordedExecution]] = {}
    for e in executions:
        if e.calls:
            by_suite.setdefault(e.suite, []).append(e)
    if not by_suite:
        raise ValueError("no recorded execution with a model call: nothing to fit suites on")
    total = sum(len(group) for group in by_suite.values())
    suites = []
    for name, group in sorted(by_suite.items()):
        turns_median, turns_sigma = _lognormal([len(e.calls) for e in group], 1.0)
        outputs = [c.output_len for e in group for c in e.calls]
        growth, gaps = [], []
        for e in group:
            for before, after in zip(e.calls[:-1], e.calls[1:], strict=True):
                growth.append(max(after.prompt_len - before.prompt_len - before.output_len, 0))
                gaps.append(after.t_start - before.t_end)
            if e.ended_at is not None:
                gaps.append(e.ended_at - e.calls[-1].t_end)
        gap_median, gap_sigma = _lognormal(gaps or [0.0], 1e-3)
        suites.append(
            Suite(
                name,
                len(group) / total,
                turns_median,
                turns_sigma,
                float(np.mean(outputs)),
                float(np.mean(growth)) if growth else 0.0,
                gap_median,
                gap_sigma,
            )
        )
    return tuple(suites)
