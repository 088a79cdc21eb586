"""Baselines that exist only in the simulator, built on the unchanged policies of scheduler/policy.py.

`PaperAsync`: the paper's async baseline, one-step-off-policy with a static split and no streaming
across steps. It wraps `Async` (same split, same staleness) and holds back every dispatch of a step
until the steps before it have finished rolling out (the next batch is generated only once the
previous one is complete), so freed slots idle through a step's tail instead of starting the next
step; run it on a preset with `stream_training=False` (a batch trains once it is complete).
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.policy import Async, AsyncConfig, Decision, SchedulerState


class PaperAsync:
    """`Async` with a barrier between steps' rollouts."""

    def __init__(self, config: AsyncConfig, group_size: int) -> None:
        self.inner = Async(config)
        self.group_size = group_size

    def decide(self, state: SchedulerState) -> Decision:
        decision = self.inner.decide(state)
        unfinished = [s.step for s in state.steps if s.finished_groups * self.group_size < s.executions]
        first = min(unfinished, default=None)
        kept = tuple(d for d in decision.dispatch if first is None or d.step <= first)
        return replace(decision, dispatch=kept, reason=decision.reason + ", barrier between steps")
