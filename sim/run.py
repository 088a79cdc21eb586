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

Pieces: sim/state.py (the modelled parts and the books), sim/result.py (RunResult and lower_bound);
this module is the event loop over them.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque

import numpy as np

from scheduler.policy import CellState, Decision, Policy, SchedulerState, StepProgress
from sim.presets import Preset, Workload, sample_workload
from sim.result import RunResult, lower_bound
from sim.state import SimCell, SimEngine, SimExecution, StepBook, Tally

ENGINE_STEP, PREFILL_END, GAP_END, DEADLINE, SWITCH_DONE, TRAIN_DRAINED, UPDATE_DONE, TICK = range(8)
STEP_WINDOW = 4  # steps the controller lists in the state (a window of the campaign)
STALL_FACTOR = 50  # a run past 50x its lower bound is a policy that stopped dispatching


class Simulation:
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

    # ---- rollout: admission (KV room), continuous batching, tool gaps -------------------------------

    def _dispatch(self, step: int, count: int) -> None:
        s = self.steps
        self.tally.max_lag = max(self.tally.max_lag, step - self.version)
        first = s.dispatched[step]
        if first + count > self.p.executions_per_step:
            raise RuntimeError(f"the policy dispatched more executions of step {step} than it holds")
        s.dispatched[step] += count
        self.tally.first_dispatch.setdefault(step, self.now)
        self.tally.last_dispatch[step] = self.now
        w = self.work
        for e in self.execs[step][first : first + count]:
            e.version, e.started = self.version, self.now
            self.dispatched += 1
            self.unfinished_by_version[e.version] = self.unfinished_by_version.get(e.version, 0) + 1
            e.pending = float(w.decode_tokens[e.step, e.index, 0])
            e.prefill_due = self._new_tokens(e, 0)
            e.kv = float(w.context[e.step, e.index, 0])
            self._wait(e)
            self._push(self.now + self.p.deadline_s, DEADLINE, e)
        self._admit()

    def _new_tokens(self, e: SimExecution, segment: int) -> float:
        prefill = self.work.prefill_tokens
        return 0.0 if prefill is None else float(prefill[e.step, e.index, segment])

    def _wait(self, e: SimExecution, first: bool = False) -> None:
        """Queues an execution for KV room (a preempted or displaced one goes first)."""
        e.state, e.seg_end = "waiting", self.now
        if first:
            self.waiting.appendleft(e)
        else:
            self.waiting.append(e)

    def _admit(self) -> None:
        """Places waiting executions, oldest first, on engines with KV room for their context."""
        while self.waiting:
            e = self.waiting[0]
            if e.done or e.state != "waiting":
                self.waiting.popleft()
                continue
            engine = self._engine_for(e.kv)
            if engine is None:
                return
            self.waiting.popleft()
            self.tally.waited_s += self.now - e.seg_end
            self._host(e, engine)
            self._prefill(e, self.p.engine.prefill_s(e.prefill_due))

    def _engine_for(self, tokens: float) -> SimEngine | None:
        """The ready rollout engine with the most free KV that fits `tokens` and has a session free
        (an empty engine takes any one execution: a context above its capacity must run somewhere)."""
        best, best_key = None, None
        for engine in self.rollout_engines:
            if engine.hosted >= engine.max_sessions:
                continue
            free = engine.kv_capacity - engine.kv_used
            if free < tokens and engine.hosted > 0:
                continue
            key = (free, -engine.hosted)
            if best_key is None or key > best_key:
                best, best_key = engine, key
        return best

    def _refresh_engines(self) -> None:
        self.rollout_engines = [
            engine for c in self.cells if c.role == "rollout" and c.phase == "ready" for engine in c.engines
        ]

    def _occupancy(self, cell: SimCell) -> None:
        """Rollout work = slot-seconds used / slots: the share of its sessions a cell hosts."""
        self.tally.busy_s["rollout"] += (
            cell.hosted / self.p.engine.sessions_per_cell * (self.now - cell.hosted_mark)
        )
        cell.hosted_mark = self.now

    def _host(self, e: SimExecution, engine: SimEngine) -> None:
        cell = self.cells[engine.cell]
        self._occupancy(cell)
        cell.hosted += 1
        cell.sessions.add(e)
        cell.kv_tokens += e.kv
        engine.hosted += 1
        engine.peak_hosted = max(engine.peak_hosted, engine.hosted)
        engine.kv_used += e.kv
        e.cell, e.engine = cell.idx, engine

    def _unhost(self, e: SimExecution) -> None:
        """Takes an execution off its engine (out of the batch if it decodes), freeing its KV."""
        engine = e.engine
        assert engine is not None
        if e.state == "decode":
            e.pending = self._leave(e)
        cell = self.cells[engine.cell]
        self._occupancy(cell)
        cell.hosted -= 1
        cell.sessions.discard(e)
        cell.kv_tokens -= e.kv
        engine.hosted -= 1
        engine.kv_used -= e.kv
        e.cell, e.engine = -1, None

    def _prefill(self, e: SimExecution, seconds: float) -> None:
        """Prefills (the segment's new tokens, or a whole context) and then decodes `e.pending`."""
        e.prefill_due = 0.0
        if seconds <= 0:
            self._join(e)
            return
        e.state = "prefill"
        self._schedule(e, self.now + seconds, PREFILL_END)

    def _demand(self) -> int:
        """Cores wanted now: each decoding or training cell one (during the update only the core
        works: optimizer step, checkpoint, publication; the satellites wait)."""
        training = 1 if self.updating else self._train_cells() if self._training() else 0
        return sum(1 for c in self.cells if c.decoding > 0) + math.ceil(training)

    def _speed(self) -> float:
        """CPU presets share cores between everything that wants one; GPU cells run at full speed."""
        cores = self.p.cluster.shared_cores
        if cores is None:
            return 1.0
        return min(1.0, cores / max(self._demand(), 1))

    def _cores_changing(self) -> None:
        """A cell starts or stops decoding: on shared cores that changes everyone's speed, so the
        training is integrated up to now at the speed it had (the next tick reschedules its end)."""
        if self.p.cluster.shared_cores is not None:
            self._advance_training()

    # ---- the continuous batch of one engine

    def _advance(self, engine: SimEngine) -> None:
        if engine.batch:
            engine.vclock += (self.now - engine.mark) / engine.step_s
        engine.mark = self.now

    def _rerate(self, engine: SimEngine) -> None:
        """Recomputes the step latency of the batch as it is now and reschedules its next finish."""
        engine.gen += 1
        heap = engine.finishing
        while heap and (heap[0][2].gen != heap[0][3] or heap[0][2].state != "decode"):
            heapq.heappop(heap)
        if not engine.batch:
            return
        engine.step_s = self.p.engine.step_latency(engine.batch, engine.context_sum) / self._speed()
        if heap:
            delay = max(heap[0][0] - engine.vclock, 0.0) * engine.step_s
            self._push(self.now + delay, ENGINE_STEP, engine, engine.gen)

    def _join(self, e: SimExecution) -> None:
        """`e` starts decoding its `pending` tokens in its engine's batch."""
        engine = e.engine
        assert engine is not None
        self._advance(engine)
        self._cores_changing()
        context = float(self.work.context[e.step, e.index, e.segment])
        engine.batch += 1
        engine.context_sum += context
        self.cells[engine.cell].decoding += 1
        e.state, e.gen = "decode", e.gen + 1
        e.v_end = engine.vclock + e.pending
        self.seq += 1
        heapq.heappush(engine.finishing, (e.v_end, self.seq, e, e.gen))
        self._batch_changed(engine)

    def _leave(self, e: SimExecution) -> float:
        """`e` leaves its engine's batch; returns the tokens it had left to decode."""
        engine = e.engine
        assert engine is not None
        self._advance(engine)
        self._cores_changing()
        engine.batch -= 1
        engine.context_sum -= float(self.work.context[e.step, e.index, e.segment])
        if engine.batch == 0:
            engine.context_sum = 0.0
        self.cells[engine.cell].decoding -= 1
        e.state, e.gen = "leaving", e.gen + 1
        left = max(e.v_end - engine.vclock, 0.0)
        self._batch_changed(engine)
        return left

    def _batch_changed(self, engine: SimEngine) -> None:
        if self.p.cluster.shared_cores is None:
            self._rerate(engine)
        else:  # on shared cores every engine's speed follows the number of busy cells
            for other in self.engines:
                if other is not engine:
                    self._advance(other)
                self._rerate(other)

    def _engine_step(self, engine: SimEngine) -> None:
        """Sequences whose tokens are all decoded go to their tool gap."""
        self._advance(engine)
        heap = engine.finishing
        done = []
        tolerance = 1e-6 + 1e-9 * engine.vclock
        while heap and heap[0][0] <= engine.vclock + tolerance:
            _, _, e, gen = heapq.heappop(heap)
            if e.gen == gen and e.state == "decode":
                done.append(e)
        for e in done:
            self._leave(e)
            e.state = "gap"
            self._schedule(e, self.now + float(self.work.gaps_s[e.step, e.index, e.segment]), GAP_END)
        if not done:
            self._rerate(engine)

    def _schedule(self, e: SimExecution, when: float, kind: int) -> None:
        e.gen += 1
        e.seg_end = when
        self._push(when, kind, e, e.gen)

    def _gap_end(self, e: SimExecution) -> None:
        """The tool returned: the next segment grows the context (its new tokens are prefilled) if
        the engine has KV room; otherwise the execution is preempted and waits to recompute."""
        if e.segment + 1 == self.p.segments:
            self._finish(e, timeout=False)
            return
        w = self.work
        k = e.segment + 1
        context = float(w.context[e.step, e.index, k])
        engine = e.engine
        if engine is not None and (
            engine.kv_used - e.kv + context <= engine.kv_capacity or engine.hosted == 1
        ):
            cell = self.cells[engine.cell]
            engine.kv_used += context - e.kv
            cell.kv_tokens += context - e.kv
            e.kv, e.segment = context, k
            e.pending = float(w.decode_tokens[e.step, e.index, k])
            self._prefill(e, self.p.engine.prefill_s(self._new_tokens(e, k)))
            return
        if engine is not None:
            self.tally.preemptions += 1
            self._unhost(e)
        e.segment, e.kv = k, context
        e.pending = float(w.decode_tokens[e.step, e.index, k])
        e.prefill_due = context  # its KV is gone: the whole context is computed again
        self._wait(e, first=True)
        self._admit()

    def _migrate_all(self, cell: SimCell) -> None:
        """Moves every session of a cell leaving rollout to the engines that stay (KV at the
        migration bandwidth; one in a tool gap moves during the gap). With no KV room left it waits
        and recomputes its context when placed."""
        for e in sorted(cell.sessions, key=lambda e: (e.step, e.index)):
            self._migrate(e)
        self._admit()

    def _migrate(self, e: SimExecution) -> None:
        engine = self.p.engine
        move_s = engine.migrate_fixed_s + e.kv * engine.kv_bytes_per_token / engine.migrate_bytes_per_s
        state = e.state
        if state == "prefill":
            e.prefill_due = 0.0  # restarts its prefill after the move (counted in the move)
        self._unhost(e)
        target = self._engine_for(e.kv)
        if target is None:
            if state == "gap":
                e.state = "unplaced"  # its tool runs on; at the gap's end it waits for an engine
            else:
                e.prefill_due = e.kv
                e.gen += 1
                self._wait(e, first=True)
            return
        self._host(e, target)
        self.tally.migrations += 1
        if state == "gap":
            e.state = "gap"
            self._schedule(e, max(e.seg_end, self.now + move_s), GAP_END)  # KV moves during the gap
        else:
            self._prefill(e, move_s)

    def _finish(self, e: SimExecution, timeout: bool) -> None:
        if e.engine is not None:
            self._unhost(e)
        e.done = True
        e.state = "done"
        self.finished += 1
        self.unfinished_by_version[e.version] -= 1
        t = self.tally
        t.finished += 1
        t.timeouts += timeout
        self.timed_out[e.step, e.index] = timeout
        t.over_4h += self.now - e.started >= 4 * 3600
        t.last_finish[e.step] = self.now
        share = (e.segment + 0.5) / self.p.segments if timeout else 1.0
        s = self.steps
        s.finished[e.step] += 1
        group = e.index // self.p.group_size
        tokens = float(self.work.train_tokens[e.step, e.index]) * share
        s.group_tokens[e.step][group] += tokens
        self.trained_tokens += tokens
        s.group_left[e.step][group] -= 1
        if s.group_left[e.step][group] == 0:
            self._advance_training()
            s.finished_groups[e.step] += 1
            if self.p.stream_training:
                s.backlog[e.step] += s.group_tokens[e.step][group]
            else:
                s.held[e.step] += s.group_tokens[e.step][group]
                if s.finished_groups[e.step] == self.p.groups_per_step:
                    s.backlog[e.step] += s.held[e.step]
            self._training_changed()
        self._admit()

    # ---- training (fluid micro-batches) ---------------------------------------------------------

    def _train_cells(self) -> float:
        """Ready train cells, in full-rate cells: below the model's minimum footprint they offload
        and train at `offload_efficiency` of their rate."""
        if self.ready_train >= self.p.trainer.min_cells:
            return self.ready_train
        return self.ready_train * self.p.trainer.offload_efficiency

    def _training(self) -> bool:
        return self.version < self.p.steps and (self.updating or self.steps.backlog[self.version] > 0)

    def _advance_training(self) -> None:
        """Trains the oldest untrained step's backlog from the last mark to now (and, on shared
        cores, counts the core-seconds used since the mark: nothing changed in between)."""
        dt = self.now - self.train_mark
        self.train_mark = self.now
        if dt > 0 and self.p.cluster.shared_cores is not None:
            self.tally.core_busy_s += dt * min(self.p.cluster.shared_cores, self._demand())
        if dt <= 0 or not self._training():
            return
        cells = self.ready_train if self.updating else self._train_cells()
        self.tally.busy_s["train"] += cells * dt
        if self.updating:
            self.update_left -= dt * self._speed()
        else:
            rate = cells * self.train_rate * self._speed()
            self.steps.backlog[self.version] = max(0.0, self.steps.backlog[self.version] - rate * dt)

    def _training_changed(self) -> None:
        """Reschedules the drain of the backlog, or starts the update once the batch is done."""
        self._advance_training()
        if self.version >= self.p.steps:
            return
        if self.updating:
            if self.p.cluster.shared_cores is not None:  # its speed may have changed since it started
                self.train_gen += 1
                self._push(
                    self.now + max(self.update_left, 0.0) / self._speed(), UPDATE_DONE, None, self.train_gen
                )
            return
        self.train_gen += 1
        backlog = self.steps.backlog[self.version]
        if backlog > 1e-6:
            rate = self._train_cells() * self.train_rate * self._speed()
            if rate > 0:
                self._push(self.now + backlog / rate, TRAIN_DRAINED, self.train_gen)
        elif self.steps.finished_groups[self.version] == self.p.groups_per_step:
            self.steps.backlog[self.version] = 0.0
            # on shared cores the update is CPU work like any other: it slows while engines decode
            self.updating, self.update_left = True, self.p.trainer.update_s
            self._push(self.now + self.update_left / self._speed(), UPDATE_DONE, None, self.train_gen)

    def _update_done(self) -> None:
        self._advance_training()
        if self.p.cluster.shared_cores is not None and self.update_left > 1e-6 * self.p.trainer.update_s:
            # slowed down since it was scheduled: not done yet
            self._training_changed()
            return
        self.updating = False
        self.version += 1
        if self.version == self.p.steps:
            self.makespan = self.now
            return
        self._training_changed()

    def _close_accounts(self) -> None:
        for cell in self.cells:
            self._account(cell)
            self._occupancy(cell)


def simulate(
    preset: Preset, policy: Policy, name: str, depth: int, work: Workload | None = None
) -> RunResult:
    """Runs one campaign; `depth` (steps the policy keeps in flight) only sets the chain bound."""
    return Simulation(preset, policy, work).run(name, depth)
