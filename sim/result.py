"""What one simulated campaign measured (RunResult, its JSON row) and the lower bound it is read against
(``lower_bound``: SCHEDULER-NOTES' work and chain terms); sim/run.py produces both."""

from __future__ import annotations

from dataclasses import dataclass

from sim.presets import Preset, Workload


@dataclass(frozen=True)
class Bound:
    """A lower bound on the makespan and its two terms."""

    work_s: float
    """(Slot-seconds of all executions at batch-1 speed / sessions per cell + training
    cell-seconds of the tokens actually trained + the updates) over all cells: no policy can keep
    the pool busier than fully."""
    chain_s: float
    """The longest dependency chain: step s cannot start before update s - depth, so the chain
    sums, over every depth-th step, its longest execution at batch-1 speed and its update."""

    @property
    def seconds(self) -> float:
        return max(self.work_s, self.chain_s)


@dataclass(frozen=True)
class RunResult:
    """What one simulated campaign measured."""

    policy: str
    makespan_s: float
    idle_train: float
    """Idle device-seconds of train cells over their device-seconds in the train role."""
    idle_rollout: float
    """Idle device-seconds of rollout cells over their device-seconds in the rollout role."""
    switches: int
    migrations: int
    """Sessions moved between engines."""
    preemptions: int
    """Executions whose context no longer fitted their engine's KV cache at a turn: they left it
    and recomputed their context when placed again."""
    waited_s: float
    """Mean seconds an execution waited for KV room (dispatched, on no engine)."""
    timeouts: int
    max_policy_lag: int
    """Largest step - version at any dispatch (the staleness of trained calls)."""
    share_over_4h: float
    """Executions that ran 4 hours or more, as simulated."""
    bound: Bound
    dispatch_spread_s: float
    """Mean over steps of the time from a step's first dispatch to its last: how long its
    executions waited for slots."""
    step_span_s: float
    """Mean over steps of the time from a step's first dispatch to its last execution's end (the
    chain term counts the longest execution alone)."""
    events: int
    wall_s: float
    """Seconds the simulation itself took."""
    cpu_busy: float | None = None
    """CPU presets: the share of the shared cores' time the cells kept busy."""

    @property
    def over_bound(self) -> float:
        return self.makespan_s / self.bound.seconds

    def figures(self) -> dict[str, float | int | str]:
        """The JSON row of this run."""
        return {
            "policy": self.policy,
            "makespan_s": round(self.makespan_s, 1),
            "makespan_h": round(self.makespan_s / 3600, 3),
            "idle_train": round(self.idle_train, 4),
            "idle_rollout": round(self.idle_rollout, 4),
            "switches": self.switches,
            "migrations": self.migrations,
            "preemptions": self.preemptions,
            "waited_s": round(self.waited_s, 1),
            "timeouts": self.timeouts,
            "max_policy_lag": self.max_policy_lag,
            "share_over_4h": round(self.share_over_4h, 4),
            "lower_bound_s": round(self.bound.seconds, 1),
            "bound_work_s": round(self.bound.work_s, 1),
            "bound_chain_s": round(self.bound.chain_s, 1),
            "over_lower_bound": round(self.over_bound, 4),
            "dispatch_spread_s": round(self.dispatch_spread_s, 1),
            "step_span_s": round(self.step_span_s, 1),
            "events": self.events,
            "sim_wall_s": round(self.wall_s, 2),
            **({} if self.cpu_busy is None else {"cpu_busy": round(self.cpu_busy, 4)}),
        }


def lower_bound(preset: Preset, work: Workload, depth: int, trained_tokens: float | None = None) -> Bound:
    """Both terms of SCHEDULER-NOTES' bound for a policy that keeps `depth` steps in flight.
    `trained_tokens`: what the run actually trained (a timed-out execution trains only the share
    it did); None counts every execution in full (before a run: an upper estimate of the work)."""
    slot_s = float(work.batch1_s.sum()) / preset.engine.sessions_per_cell
    tokens = float(work.train_tokens.sum()) if trained_tokens is None else trained_tokens
    train_s = tokens / preset.train_tokens_per_s + preset.steps * preset.trainer.update_s
    longest = work.batch1_s.max(axis=1) + preset.trainer.update_s
    chain = max(float(longest[r::depth].sum()) for r in range(min(depth, preset.steps)))
    return Bound(work_s=(slot_s + train_s) / preset.cluster.cells, chain_s=chain)
