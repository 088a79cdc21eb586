"""What bench/schedule_real.py compares: the policies, their settings, and the work every policy runs.

POLICIES are the three policies with the settings they run with on this machine's cells; RealWork is a
campaign's steps of problems (the same for every policy), WORKLOADS the shapes `--workload` chooses,
and `dispatch_config` the dispatcher's settings that give every policy the same executions. The
constants size the stack (CELLS, SESSIONS_PER_CELL, HOST_CORES) and the held-out evaluation.
bench/schedule_real_stack.py runs a policy's campaign on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.harness import HarnessConfig
from scheduler.controller import StepWork
from tasks.campaign import problems_for

POLICY = "data/policies/tiny-sft"
CELLS = 4
HELD_OUT_PROBLEMS = 24  # greedy, one execution each, generator seed 0: never trained on (7000+, 8000+)
SESSIONS_PER_CELL = 2
SUITES = ["terminal", "repo", "swe"]
DURATIONS = DurationProfile(short_turns=3, long_fraction=0.25, long_factor=(3.0, 6.0))
MAX_TOKENS = 96
# The host's share when partitioned: the gateway, the dispatcher and every harness with its commands
# (what runs on a GPU host's CPUs, beside its devices) get 1 core; the 4 cells share the other (0.25
# core each), so a cell's quota binds and a freed cell's share is lost unless it changes role.
HOST_CORES = 1.0

# The policies as compared: elastic and async keep two steps in flight (lag <= 1), colocate one.
# On CPU the training backlog is not estimated (train_backlog_s is 0), so elastic's "does the switch
# pay" test is off (gain_factor 0): it moves whenever the rollout capacity left covers the work.
# A step here trains a few seconds of a 20-30 s rollout, so elastic lends the core to rollout while a
# step rolls out its bulk (lend_core; before 2026-12-06 the core always trained, and elastic made
# async's one switch: 0.994x async).
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "colocate": ("colocate", {}),
    "async": ("async", {"train_cells": 1, "max_policy_lag": 1}),
    "elastic": (
        "elastic",
        {"depth": 2, "max_policy_lag": 1, "min_dwell_s": 2.0, "gain_factor": 0.0, "lend_core": True},
    ),
}


@dataclass(frozen=True)
class RealWork:
    steps: int
    problems_per_step: int
    group_size: int
    seed: int
    temperature: float = 1.0  # the harness's sampling temperature (held-out runs: greedy)
    sessions_per_cell: int = SESSIONS_PER_CELL  # executions a rollout cell runs at once

    def steps_work(self) -> list[StepWork]:
        return [
            StepWork(
                step,
                [p.to_json() for p in problems_for(SUITES, self.problems_per_step, self.seed + step, 1, 1)],
                self.group_size,
            )
            for step in range(self.steps)
        ]


# The workloads `--workload` chooses (compare's steps and seed are the same for each):
# default: the campaign's (groups of 2 at temperature 1.0, where about one group in eight has a signal);
# signal: more of the groups carry a signal, so a step trains 5-8x the tokens (groups of 4 at
# temperature 1.5, 6 executions a cell at once): experiments.md, 2026-12-05
WORKLOADS: dict[str, dict[str, Any]] = {
    "default": {"problems_per_step": 8, "group_size": 2},
    "signal": {"problems_per_step": 8, "group_size": 4, "temperature": 1.5, "sessions_per_cell": 6},
}


def dispatch_config(group_size: int, run_id: str, temperature: float = 1.0) -> DispatchConfig:
    return DispatchConfig(
        group_size=group_size,
        run_id=run_id,  # one gateway serves every policy: execution ids must differ between them
        same_work_across_runs=True,  # ...but not their work: the same long executions, the same seeds
        concurrency=1,  # the controller starts each execution itself
        timeout_s=120,
        durations=DURATIONS,
        harness=HarnessConfig(max_tokens=MAX_TOKENS, max_retries=1, max_subagents=0, temperature=temperature),
    )
