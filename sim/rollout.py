"""The rollout side of the simulation: admission for KV room, continuous batching, tool gaps, migration.

`RolloutModel` is mixed into sim/run.py's `Simulation` and works on its state (the preset `p`, the
workload `work`, the cells, engines and executions of sim/state.py, the waiting queue and the tally):
- admission: dispatched executions wait until a ready rollout engine has KV room for their context
  (the one with the most free KV); a segment's new tokens are prefilled, then it decodes;
- the continuous batch of one engine: every decoding sequence gets a token per step, the step latency
  follows the batch and its summed context and is recomputed whenever the batch changes (`vclock`
  counts the engine's steps); on shared cores every engine's speed follows the busy cells;
- tool gaps: at a turn whose context no longer fits, an execution is preempted (waits and recomputes);
- migration: a cell leaving rollout moves its sessions to the engines that stay;
- the end of an execution, which hands its group's tokens to the training (sim/training.py).
Events it pushes are sim/events.py's; the loop that pops them is sim/run.py's.
"""

from __future__ import annotations

import heapq
import math

from sim.events import DEADLINE, ENGINE_STEP, GAP_END, PREFILL_END
from sim.state import SimCell, SimEngine, SimExecution


class RolloutModel:
    """The executions and engines of a `Simulation` (sim/run.py), which holds the state these read."""

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
