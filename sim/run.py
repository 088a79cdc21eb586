"""A discrete-event simulation of a campaign, driving scheduler/policy.py unchanged.

    from sim.presets import PRESETS
    from sim.run import simulate
    result = simulate(PRESETS["paper-flagship"], make_policy("elastic"), depth=2)

One heapq event loop over modelled parts (sim/presets.py says what each preset assumes):
- executions: segments of (prefill, decode, tool gap); dispatched executions wait until an engine
  has KV room for their context (`EngineModel.kv_capacity_tokens`); a segment's new tokens are
  prefilled, then it decodes in its engine's continuous batch; at a turn whose context no longer
  fits, it is preempted (waits and recomputes); the deadline ends it as a timeout.
- engines (`SimEngine`, `Preset.engines_per_cell` per cell): every decoding sequence gets a token
  per step; the step latency follows the batch and its summed context and is recomputed whenever
  the batch changes (one clock per engine). Dispatches go to the engine with the most free KV. A
  cell leaving rollout migrates its sessions (KV bytes / bandwidth; a session in a tool gap
  migrates during the gap), never interrupting them; with no KV room left they wait.
- training streams: a group's tokens join its step's backlog when its last execution finishes;
  the ready train cells of the moment drain the oldest untrained step's backlog (a fluid model of
  micro-batches); the optimizer update follows once the step's batch is complete and trained,
  and publishes version step + 1.
- the controller: every `tick_s` it fills a `SchedulerState`, asks the policy and applies the
  decision (roles, then dispatches), exactly as scheduler/service.py will.

Figures: makespan, idle fraction per role (device-seconds without work over device-seconds in
the role; a rollout cell works in proportion to the slots it fills, sessions hosted over
sessions_per_cell, the same unit as the bound's work term; a train cell works while the step
being trained has micro-batches or its update runs; switching time counts as idle in the role
being entered), switches, and the lower bound max(work term, chain term) of `lower_bound`; per
step (means), how long its dispatches spread (executions waiting for slots) and how long from its
first dispatch to its last execution's end.

Pieces: sim/state.py (the modelled parts and the books), sim/result.py (RunResult and lower_bound),
sim/rollout.py (executions and engines), sim/training.py (the training streams), sim/events.py (the
kinds of event); this module is the event loop over them and the controller.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque

import numpy as np

from scheduler.policy import CellState, Decision, Policy, SchedulerState, StepProgress
from sim.events import (
    DEADLINE,
    ENGINE_STEP,
    GAP_END,
    PREFILL_END,
    SWITCH_DONE,
    TICK,
    TRAIN_DRAINED,
    UPDATE_DONE,
)
from sim.presets import Preset, Workload, sample_workload
from sim.result import RunResult, lower_bound
from sim.rollout import RolloutModel
from sim.state import SimCell, SimEngine, SimExecution, StepBook, Tally
from sim.training import TrainingModel

STEP_WINDOW = 4  # steps the controller lists in the state (a window of the campaign)
STALL_FACTOR = 50  # a run past 50x its lower bound is a policy that stopped dispatching


class Simulation(RolloutModel, TrainingModel):
    """One campaign of `preset` under `policy`; `run()` returns its figures."""

    def __init__(self, preset: Preset, policy: Policy, work: Workload | None = None) -> None:
        self.p = preset
        self.policy = policy
        self.work = work if work is not None else sample_workload(preset)
        self.now = 0.0
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.cells = [
            SimCell(i, f"cell-{i:04d}", i == 0, "train" if i == 0 else "rollout")
            for i in range(preset.cluster.cells)
        ]
        self.by_id = {c.cell_id: c for c in self.cells}
        per_engine = max(1, preset.engine.sessions_per_cell // preset.engines_per_cell)
        for c in self.cells:
            c.engines = [
                SimEngine(c.idx, preset.engine.kv_capacity_tokens, per_engine)
                for _ in range(preset.engines_per_cell)
            ]
        self.engines = [engine for c in self.cells for engine in c.engines]
        self.rollout_engines: list[SimEngine] = []
        self._refresh_engines()
        self.waiting: deque[SimExecution] = deque()
        self.trained_tokens = 0.0
        self.timed_out = np.zeros((preset.steps, preset.executions_per_step), dtype=bool)
        self.train_rate = preset.train_tokens_per_s
        self.ready_train = 1
        self.execs = [
            [SimExecution(s, i) for i in range(preset.executions_per_step)] for s in range(preset.steps)
        ]
        self._order_dispatch()
        n_groups, size = preset.groups_per_step, preset.group_size
        self.steps = StepBook(
            dispatched=[0] * preset.steps,
            finished_groups=[0] * preset.steps,
            finished=[0] * preset.steps,
            group_left=[[size] * n_groups for _ in range(preset.steps)],
            group_tokens=[[0.0] * n_groups for _ in range(preset.steps)],
            backlog=[0.0] * preset.steps,
            held=[0.0] * preset.steps,
        )
        self.version = 0
        self.updating = False
        self.update_left = 0.0  # seconds of the update left at full speed
        self.train_mark = 0.0
        self.train_gen = 0
        self.dispatched = 0
        self.finished = 0
        self.unfinished_by_version: dict[int, int] = {}
        self.tally = Tally()
        self.makespan = math.nan

    def _order_dispatch(self) -> None:
        """Each step's executions in the order they start (`Preset.dispatch_order`); a stable sort,
        so the members of a group with one prediction stay together."""
        order = self.p.dispatch_order
        if order == "group":
            return
        if order == "predicted":
            if self.work.predicted_s is None:
                raise ValueError(
                    f"{self.p.name}: dispatch_order 'predicted' needs a workload with a per-problem part "
                    "(set problem_share above 0): there is nothing to predict a problem's length from"
                )
            key = self.work.predicted_s
        elif order == "oracle":
            key = self.work.batch1_s
        else:
            raise ValueError(f"{self.p.name}: dispatch_order {order!r}: choose group, predicted or oracle")
        for step, execs in enumerate(self.execs):
            execs.sort(key=lambda e: -key[step, e.index])

    # ---- the loop -------------------------------------------------------------------------------

    def run(self, name: str, depth: int) -> RunResult:
        started = time.perf_counter()
        bound = lower_bound(self.p, self.work, depth)
        self._push(0.0, TICK)
        count = 0
        while self.events and self.version < self.p.steps:
            when, _, kind, target, gen = heapq.heappop(self.events)
            if when > STALL_FACTOR * bound.seconds:
                raise RuntimeError(
                    f"{name}: no progress by t={when:.0f}s (version {self.version}): the policy stalls"
                )
            self.now = when
            count += 1
            self._handle(kind, target, gen)
        self._close_accounts()
        bound = lower_bound(self.p, self.work, depth, self.trained_tokens, self.timed_out)
        t = self.tally
        role, busy = t.role_s, t.busy_s
        return RunResult(
            policy=name,
            makespan_s=self.makespan,
            idle_train=1 - busy["train"] / role["train"] if role["train"] else 0.0,
            idle_rollout=1 - busy["rollout"] / role["rollout"] if role["rollout"] else 0.0,
            switches=t.switches,
            migrations=t.migrations,
            preemptions=t.preemptions,
            waited_s=t.waited_s / max(t.finished, 1),
            timeouts=t.timeouts,
            max_policy_lag=t.max_lag,
            share_over_4h=t.over_4h / max(t.finished, 1),
            bound=bound,
            dispatch_spread_s=sum(t.last_dispatch[i] - t.first_dispatch[i] for i in t.first_dispatch)
            / max(len(t.first_dispatch), 1),
            step_span_s=sum(t.last_finish[i] - t.first_dispatch[i] for i in t.first_dispatch)
            / max(len(t.first_dispatch), 1),
            events=count,
            wall_s=time.perf_counter() - started,
            cpu_busy=None
            if self.p.cluster.shared_cores is None
            else t.core_busy_s / (self.p.cluster.shared_cores * self.makespan),
        )

    def _push(self, when: float, kind: int, target: object = None, gen: int = 0) -> None:
        """Events carry the generation of their target: a rescheduled one leaves a stale copy."""
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, target, gen))

    def _handle(self, kind: int, target: object, gen: int) -> None:
        if kind == TICK:
            self._tick()
        elif kind == ENGINE_STEP:
            assert isinstance(target, SimEngine)
            if target.gen == gen:
                self._engine_step(target)
        elif kind in (PREFILL_END, GAP_END, DEADLINE):
            assert isinstance(target, SimExecution)
            if target.done or (kind != DEADLINE and target.gen != gen):
                return
            if kind == DEADLINE:
                self._finish(target, timeout=True)
            elif kind == PREFILL_END:
                self._join(target)
            else:
                self._gap_end(target)
        elif kind == SWITCH_DONE:
            assert isinstance(target, SimCell)
            if target.switch_gen == gen:
                self._switch_done(target)
        elif kind == TRAIN_DRAINED:
            if gen == self.train_gen:
                self._training_changed()
        elif kind == UPDATE_DONE and gen == self.train_gen:  # a rescheduled update leaves a stale copy
            self._update_done()

    # ---- the controller -------------------------------------------------------------------------

    def _tick(self) -> None:
        self._advance_training()
        decision = self.policy.decide(self._state())
        self._apply(decision)
        self._training_changed()
        if self.p.cluster.shared_cores is not None:  # the training's demand for cores moves too
            for engine in self.engines:
                self._advance(engine)
                self._rerate(engine)
        self._push(self.now + self.p.tick_s, TICK)

    def _state(self) -> SchedulerState:
        p, s = self.p, self.steps
        cap_tokens = p.engine.kv_capacity_tokens * p.engines_per_cell
        if math.isinf(cap_tokens):
            cap_tokens = p.engine.max_context * p.engine.sessions_per_cell
        cells = tuple(
            CellState(
                c.cell_id, c.role, c.core, c.phase, c.since, c.hosted, min(1.0, c.kv_tokens / cap_tokens)
            )
            for c in self.cells
        )
        window = range(self.version, min(p.steps, self.version + STEP_WINDOW))
        steps = tuple(
            StepProgress(i, p.executions_per_step, s.dispatched[i], s.finished_groups[i], s.finished[i])
            for i in window
        )
        live = [v for v, n in self.unfinished_by_version.items() if n > 0]
        backlog = s.backlog[self.version] if self.version < p.steps else 0.0
        return SchedulerState(
            now=self.now,
            cells=cells,
            sessions_per_cell=p.engine.sessions_per_cell,
            dispatched=self.dispatched,
            finished=self.finished,
            steps=steps,
            policy_version=self.version,
            oldest_behaviour_version=min(live) if live else None,
            train_backlog_s=backlog / self.train_rate,
            switch_to_train_s=p.to_train_s,
            switch_to_rollout_s=p.to_rollout_s,
        )

    def _apply(self, decision: Decision) -> None:
        leaving = []
        for cell_id, role in decision.roles.items():
            cell = self.by_id[cell_id]
            if cell.role == role:
                continue
            self._advance_training()
            if cell.role == "rollout":
                leaving.append(cell)
            elif cell.phase == "ready":
                self.ready_train -= 1
            self._account(cell)
            cell.role, cell.phase, cell.since = role, "switching", self.now
            cell.switch_gen += 1
            self.tally.switches += 1
            cost = self.p.to_train_s if role == "train" else self.p.to_rollout_s
            self._push(self.now + cost, SWITCH_DONE, cell, cell.switch_gen)
        self._refresh_engines()
        for cell in leaving:
            self._migrate_all(cell)
        for order in decision.dispatch:
            self._dispatch(order.step, order.executions)

    def _switch_done(self, cell: SimCell) -> None:
        self._advance_training()
        self._account(cell)
        cell.phase = "ready"
        if cell.role == "rollout":
            self._refresh_engines()
            self._admit()
        else:
            self.ready_train += 1
        self._training_changed()

    def _account(self, cell: SimCell) -> None:
        """Closes the cell's current role period (switching counts in the role being entered)."""
        self.tally.role_s[cell.role] += self.now - cell.mark
        cell.mark = self.now

    def _close_accounts(self) -> None:
        for cell in self.cells:
            self._account(cell)
            self._occupancy(cell)


def simulate(
    preset: Preset, policy: Policy, name: str, depth: int, work: Workload | None = None
) -> RunResult:
    """Runs one campaign; `depth` (steps the policy keeps in flight) only sets the chain bound."""
    return Simulation(preset, policy, work).run(name, depth)
