"""What one simulated campaign measured (RunResult, its JSON row) and the lower bound it is read against
(``lower_bound``: SCHEDULER-NOTES' work and chain terms, the work's rollout at the engines' best
decode batch); sim/run.py produces both."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.presets import Preset, Workload


@dataclass(frozen=True)
class Bound:
    """A lower bound on the makespan and its two terms."""

    work_s: float
    """(Rollout cell-seconds + training cell-seconds of the tokens actually trained + the updates)
    over all cells: no policy can keep the pool busier than fully. Rollout: the engine-seconds no
    schedule goes below, over engines per cell: each engine is limited by its session slots, its
    decode steps and its KV cache, and a larger batch trades the first and last (sessions live
    longer) for the second (a step serves more tokens): `_rollout_engine_s`. Never below the
    slot-seconds of all executions at batch-1 speed / sessions per cell."""
    chain_s: float
    """The longest dependency chain: step s cannot start before update s - depth, so the chain
    sums, over every depth-th step, its longest execution at batch-1 speed and its update."""
    batch: float = 1.0
    """The decode batch per engine at which the rollout terms of `work_s` balance (1: the
    batch-1 slot term binds; the engine's slots: the compute term does)."""

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
            "bound_batch": round(self.bound.batch, 2),
            "over_lower_bound": round(self.over_bound, 4),
            "dispatch_spread_s": round(self.dispatch_spread_s, 1),
            "step_span_s": round(self.step_span_s, 1),
            "events": self.events,
            "sim_wall_s": round(self.wall_s, 2),
            **({} if self.cpu_busy is None else {"cpu_busy": round(self.cpu_busy, 4)}),
        }


def lower_bound(
    preset: Preset,
    work: Workload,
    depth: int,
    trained_tokens: float | None = None,
    timed_out: np.ndarray | None = None,
) -> Bound:
    """Both terms of SCHEDULER-NOTES' bound for a policy that keeps `depth` steps in flight.
    `trained_tokens`: what the run actually trained (a timed-out execution trains only the share
    it did); None counts every execution in full (before a run: an upper estimate of the work).
    `timed_out`: [step, execution] the executions the run ended at their deadline (they count at
    their batch-1 slot time only); None: those whose batch-1 duration reaches it."""
    timed = work.batch1_s >= preset.deadline_s
    if timed_out is not None:
        timed = timed | timed_out
    engine_s, batch = _rollout_engine_s(preset, work, timed)
    tokens = float(work.train_tokens.sum()) if trained_tokens is None else trained_tokens
    train_s = tokens / preset.train_tokens_per_s + preset.steps * preset.trainer.update_s
    longest = work.batch1_s.max(axis=1) + preset.trainer.update_s
    chain = max(float(longest[r::depth].sum()) for r in range(min(depth, preset.steps)))
    work_s = (engine_s / preset.engines_per_cell + train_s) / preset.cluster.cells
    return Bound(work_s=work_s, chain_s=chain, batch=batch)


def _rollout_engine_s(preset: Preset, work: Workload, timed_out: np.ndarray) -> tuple[float, float]:
    """Engine-seconds of rollout no schedule goes below, and the decode batch its terms balance at.

    Per engine (S slots, a KV cache of K tokens; f, p, c the latency terms), a token of context x
    decoded in a batch of B sequences takes f / B + p + c x seconds of the engine's decode (its share
    of the step) and holds its session's slot for f + B (p + c x) (the step, whose attention over the
    batch's summed context is reattributed to its sequences by their own contexts: equal summed over
    a batch). A session keeps its slot and its KV through its prefills and tool gaps too (`held`
    seconds per segment). Summed over all engines and every execution that finished (N tokens, Q
    their p + c x), engine-seconds >= each of
      slot:    (Σ held + f N + Σ_tokens B (p + c x)) / S
      compute: Σ_tokens f / B + Q
      KV:      (Σ_segments x held + Σ_tokens x (f + B p) + attention) / K, where a step holds the
               batch's KV for its attention c Σ_batch x too: c (Σ_batch x)² >= c B x̄ (2 Σ_batch x - B x̄)
               per step (a tangent at the mean context x̄: exact where a batch's contexts are alike);
               a context above K runs alone, so it counts as K.
    A larger batch lengthens the slot and KV terms (sessions live longer) and shortens the compute
    term (a step serves more tokens). At one batch b for every token, min over b in [1, S] of the
    largest term is where they balance (b, reported). A schedule may batch tokens of different
    contexts differently, though, so the bound is the Lagrangian dual at the weights that balance the
    terms at b: their weighted sum with each segment at its own best batch in [1, S]: valid whatever
    the batches, equal to the one-batch value where contexts are alike and a little below it
    otherwise; and never below the batch-1 slot term (the weights on the slot term alone: the old
    bound, every execution's batch-1 duration over the slots).

    Timed-out executions count at their batch-1 slot time only (no batching surcharge, no compute,
    no KV: they did an unknown share). With any of them in a batch, its attention is no longer
    attributable to the finished sequences, so each token then counts only its own (c x, not
    batched). On shared cores (CPU presets) a step runs slower, never faster: the terms hold there.
    Like the batch-1 term, every tool gap and prefill counts as held, although a session migrated
    with no room left sits the rest of its gap off any engine and a preempted one recomputes its
    context instead of prefilling the new tokens (either can hold a little less)."""
    e = preset.engine
    f, p, c = e.latency_fixed_s, e.latency_per_seq_s, e.latency_per_ctx_token_s
    slots = max(1, e.sessions_per_cell // preset.engines_per_cell)
    done = ~timed_out
    n, x, held = work.decode_tokens[done].ravel(), work.context[done].ravel(), work.gaps_s[done].ravel()
    if work.prefill_tokens is not None:
        held = held + e.prefill_s(work.prefill_tokens[done].ravel())
    batched = 0.0 if timed_out.any() else 1.0  # the batch's attention, reattributed by context
    # each term: a constant and, per token, a coefficient of its batch (engine-seconds)
    spent = float(np.minimum(work.batch1_s[timed_out], preset.deadline_s).sum())
    slot0 = (spent + held.sum() + n @ (f + (1 - batched) * c * x)) / slots
    slot_b = (p + batched * c * x) / slots
    compute0, compute_inv = float(n @ (p + c * x)), f * float(n.sum())
    kv0, kv_b = 0.0, np.zeros_like(x)
    capacity = e.kv_capacity_tokens
    if n.sum() > 0 and 0 < capacity < math.inf:
        kept = np.minimum(x, capacity)  # one longer context runs alone: the cache holds at most K
        mean = float(n @ kept) / float(n.sum())
        kv0 = float(kept @ held + n @ (kept * (f + (1 - batched) * c * kept))) / capacity
        kv_b = (kept * p + batched * c * mean * (2 * kept - mean)) / capacity

    def dual(w_slot: float, w_compute: float, w_kv: float) -> float:
        """The weighted sum of the terms, each segment at its best batch in [1, slots]."""
        a, m = w_slot * slot_b + w_kv * kv_b, w_compute * f
        b = np.clip(np.sqrt(np.divide(m, a, out=np.full_like(a, np.inf), where=a > 0)), 1, slots)
        return w_slot * slot0 + w_compute * compute0 + w_kv * kv0 + float(n @ (b * a + m / b))

    b = np.linspace(1, slots, 1 + 400 * (slots - 1))
    rising = np.array([slot0 + float(n @ slot_b) * b, kv0 + float(n @ kv_b) * b])  # slot, KV
    compute = compute0 + compute_inv / b
    i = int(np.argmin(np.maximum(rising.max(axis=0), compute)))
    batch, term = float(b[i]), int(np.argmax(rising[:, i]))
    slope = float(n @ (slot_b, kv_b)[term])
    if rising[term, i] >= compute[i] and i == 0:
        w_compute = 0.0  # the batch-1 slot or KV term alone
    elif compute[i] >= rising[term, i] and i == len(b) - 1:
        w_compute = 1.0  # the compute term at full batch
    else:  # the weights at which the balancing terms' slopes cancel at the batch
        w_compute = slope / (slope + compute_inv / batch**2) if slope > 0 else 0.0
    weights = (1 - w_compute, w_compute, 0.0) if term == 0 else (0.0, w_compute, 1 - w_compute)
    return float(max(dual(1.0, 0.0, 0.0), dual(*weights))), batch
