"""Elastic data parallel: satellites join a training step that is already running, and the step's
micro-batches may still be arriving (a streaming step). This module is the core's side
(ElasticCoordinator, StreamingStep, StepReport); a satellite's side is engines/train/satellite.py
(``run_satellite``), and what both use is engines/train/elastic_protocol.py.

One step, as the core cell runs it:

1. ``ElasticCoordinator.open_step`` publishes the step's weights to the fast in-host path and opens
   the step on a long-lived TCPStore: ``meta`` = {version, weights, normalizer if known, ...} and an
   empty stream (stream.py has the queue's keys).
2. A producer appends chunks of micro-batches over time and closes the step with its number of
   executions; or the core closes it at its deadline with what has arrived. ``run_step`` (the
   non-streaming step) is a step whose whole batch is one chunk, closed at once.
3. ``StreamingStep.train``: everyone (the core is participant 0) claims arrived micro-batches one
   at a time and adds their gradients to a local flat buffer; an idle participant waits for the
   next arrival. A satellite may join at any moment: it takes a participant id, pulls the weights
   (version-checked), says it is active and claims what is there; so everyone finishes together.
   A satellite asked to leave (its cell goes back to rollout) finishes its current micro-batch,
   writes its gradient sum next to the weights, names it on the store and is gone: the core adds
   that file, and the cell serves rollouts at once instead of waiting for the reduction.
4. Once the step is closed and every micro-batch claimed, the core waits until every active
   satellite has finished, left or died (heartbeats). Micro-batches claimed by a dead satellite died
   with its buffer, so the core computes them again: every micro-batch counts exactly once. A
   satellite found dead while the step still streams is evicted at once (what it says later is
   ignored) and its micro-batches are recomputed then, so a death does not lengthen the tail.
5. The core names the members (itself + finished satellites that computed something); they form
   a gloo group from the TCPStore plus a PrefixStore and reduce their gradient sums once. If that
   fails (a member died inside it), the core restores its own sum, recomputes every other member's
   micro-batches and goes on alone: slower, still exact.
6. The core scales the sum by the normalizer if it was not known at open, and applies it
   (CoreTrainer.apply): a new policy version. A step closed with no micro-batches makes a new
   version without an optimizer step, as engines/train/run.py does for an empty batch.

Exactness. Gradient sums are fp64 (worker.py), so who computed which micro-batch, in what order,
and whether a sum travelled through gloo or a handoff file does not change the result: a streaming
step with satellites equals the same streaming step of the core alone bit for bit (in practice).
One floating-point order differs between a step whose normalizer is known at open (``run_step``:
each micro-batch's loss is divided by n_executions before its backward, in fp32) and a streaming
step (the unnormalized fp32 gradients are summed in fp64 and the sum is divided by n_executions
once): the two updates agree to about 1e-7 relative, not bitwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from engines.model.weights import read_weights, remove_file, save_weights
from engines.train.core import CoreTrainer
from engines.train.elastic_protocol import (
    CORE,
    ElasticConfig,
    Idle,
    has,
    reduce_sums,
    stats_from_record,
)
from engines.train.stream import (
    ChunkCache,
    StreamState,
    append_chunk,
    claimed,
    close_stream,
    open_stream,
    read_state,
    step_store,
    try_claim,
)
from engines.train.worker import StepStats
from trajectory_store.processor import PackedSequence

__all__ = ["ElasticCoordinator", "StepReport", "StreamingStep"]


@dataclass
class StepReport:
    step: int
    version: int  # the policy version after the step
    micro_batches: int
    members: list[int]  # participants whose gradients were reduced (0 = the core)
    by_participant: dict[int, list[int]]  # micro-batches of each member and each satellite that left
    recomputed: list[int]  # micro-batches the core redid for satellites that died (all of them)
    dead: list[int]
    stats: StepStats
    grad_norm: float
    reduce_attempts: int
    timings: dict[str, float] = field(default_factory=dict)
    # what streaming adds
    n_executions: int = 0  # the loss normalizer the step closed with
    trained: bool = True  # False: closed with no micro-batches, a new version without an optimizer step
    closed_by: str = "producer"  # "producer" | "deadline"
    left: list[int] = field(default_factory=list)  # satellites that left mid-step (sums handed over)
    arrivals_s: list[float] = field(default_factory=list)  # per micro-batch: seconds after open it arrived
    wait_s: dict[int, float] = field(default_factory=dict)  # per participant: idle, waiting for arrivals
    recomputed_early: list[int] = field(default_factory=list)  # of ``recomputed``: while the step streamed

    def metrics(self) -> dict[str, float]:
        s = self.stats
        tokens = max(s.tokens, 1)
        return {
            "loss": s.loss,
            "clip_fraction": s.clipped / tokens,
            "ratio_mean": s.ratio_sum / tokens,
            "ratio_max": s.ratio_max,
            "grad_norm": self.grad_norm,
            "entropy": s.entropy_sum / tokens,
            "kl": s.kl_sum / tokens,
            "tokens_trained": float(s.tokens),
            "policy_lag_mean": s.lag_sum / tokens,
            "policy_lag_max": float(s.lag_max),
            "satellites": float(len(self.members) - 1),
            "satellites_left": float(len(self.left)),
            "micro_batches": float(self.micro_batches),
            "core_micro_batches": float(len(self.by_participant.get(CORE, []))),  # rank 0's own
            "last_arrival_s": max(self.arrivals_s, default=0.0),
            "core_wait_s": self.wait_s.get(CORE, 0.0),
            **{f"{k}_s": v for k, v in self.timings.items()},
        }


class ElasticCoordinator:
    """Runs elastic steps on the core cell; owns the long-lived TCPStore server."""

    def __init__(
        self,
        core: CoreTrainer,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        config: ElasticConfig | None = None,
    ):
        self.core = core
        self.config = config or ElasticConfig()
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.host, self.port = host, self.store.port

    def open_step(
        self,
        step: int,
        *,
        weights_dir: str,
        n_executions: int | None = None,
        deadline_s: float | None = None,
        final: bool = True,
        share_url: str | None = None,
    ) -> StreamingStep:
        """Opens a step whose micro-batches will arrive later (``StreamingStep``). ``n_executions``,
        when known now, is the normalizer (then each micro-batch is divided by it, as run_step
        does); ``deadline_s`` after opening, the core closes the step with what has arrived.
        ``final`` False: the update is one of several of the step (TrainerConfig.mini_batches), and
        makes no new version. ``share_url``: a folder every participant can read and write (the
        campaign's object storage), for satellites on other hosts: the step's weights are written
        there too, and a satellite that leaves hands its gradient sum over there."""
        return StreamingStep(self, step, weights_dir, n_executions, deadline_s, final, share_url)

    def run_step(
        self,
        step: int,
        sequences: list[PackedSequence],
        n_executions: int,
        *,
        batch_uri: str,
        weights_dir: str,
        pace_s: float = 0.0,
        on_micro_batch: Callable[[int], None] | None = None,
        final: bool = True,
        share_url: str | None = None,
    ) -> StepReport:
        """One elastic step over ``sequences`` (also readable by satellites at ``batch_uri``): a
        streaming step whose batch is one chunk, closed at once.

        ``pace_s`` slows the core down per micro-batch (tests and benchmarks use it so that
        satellites have something left to take); ``final`` and ``share_url`` as in ``open_step``."""
        opened = self.open_step(
            step, weights_dir=weights_dir, n_executions=n_executions, final=final, share_url=share_url
        )
        opened.append(batch_uri, n_executions, sequences=sequences)
        opened.close(n_executions)
        return opened.train(pace_s=pace_s, on_micro_batch=on_micro_batch)

    def close(self) -> None:
        del self.store


class StreamingStep:
    """One open step on the core. Producers append (here, or from another process through
    stream.StreamProducer at ``address``); ``train`` is the core's share, then the update."""

    def __init__(
        self,
        coordinator: ElasticCoordinator,
        step: int,
        weights_dir: str,
        n_executions: int | None,
        deadline_s: float | None,
        final: bool = True,
        share_url: str | None = None,
    ):
        started = time.perf_counter()
        self.coordinator, self.config, self.step, self.final = coordinator, coordinator.config, step, final
        self.store = step_store(coordinator.store, step)
        if has(self.store, "meta"):
            raise ValueError(f"step {step} was already opened on this store")
        if n_executions is not None and n_executions < 1:
            raise ValueError(f"a normalizer known at open must be >= 1, got {n_executions}")
        core = coordinator.core
        self.normalizer = n_executions  # None: applied to the reduced sum (a streaming step)
        name = f"step{step}-v{core.version}.safetensors"
        weights_path = f"{weights_dir}/{name}"
        state = core.engine.module.state_dict()
        save_weights(state, weights_path, core.version)
        shared = None if share_url is None else f"{share_url.rstrip('/')}/{name}"
        if shared is not None:  # for satellites on other hosts
            save_weights(state, shared, core.version)
        core.sync_worker()
        core.worker.reset()
        self.version = core.version
        self.cache = ChunkCache()
        self.evicted: set[int] = set()  # satellites found dead while the step streamed
        self.recomputed: list[int] = []
        self._first_seen: dict[int, float] = {}
        open_stream(self.store)
        self.opened_at = time.time()
        self.deadline = None if deadline_s is None else self.opened_at + deadline_s
        self.store.set(
            "meta",
            json.dumps(
                {
                    "step": step,
                    "version": core.version,
                    "n_executions": n_executions,
                    "core_address": coordinator.host,
                    "weights": weights_path,  # on the core's host
                    "weights_url": shared,  # anywhere (None: satellites share the core's host)
                    "handoff_dir": share_url or weights_dir,
                    "opened_at": self.opened_at,
                }
            ),
        )
        self._started = started
        self._published = time.perf_counter()
        self.ranks_invited = 0  # the other ranks of a core of several compute this step too
        if core.world is not None and core.rank == 0:
            core.invite(self.address)
            self.ranks_invited = core.ranks - 1

    @property
    def address(self) -> tuple[str, int, int]:
        """(host, port, step): what a StreamProducer or a satellite needs to reach this step."""
        return self.coordinator.host, self.coordinator.port, self.step

    def append(
        self,
        uri: str,
        n_executions: int,
        *,
        sequences: list[PackedSequence] | None = None,
        n_sequences: int | None = None,
        key: str | None = None,
    ):
        """Appends the chunk at ``uri``; in-process ``sequences`` spare the core reading it back.
        Safe from another thread than ``train``'s (TCPStore operations are serialized)."""
        if sequences is None and n_sequences is None:
            raise ValueError("say how many sequences the chunk holds (n_sequences), or pass them")
        count = len(sequences) if sequences is not None else n_sequences
        if sequences is not None:  # before the append: the core may claim from it at once
            self.cache.put(key or uri, list(sequences))
        return append_chunk(self.store, uri, count, n_executions, key)

    def close(self, n_executions: int | None = None) -> StreamState:
        return close_stream(self.store, n_executions)

    # -- the core's share -------------------------------------------------------------------------
    def train(
        self, *, pace_s: float = 0.0, on_micro_batch: Callable[[int], None] | None = None
    ) -> StepReport:
        """Claims micro-batches until the step is closed and drained, then reduces and applies."""
        try:
            return self._train(pace_s, on_micro_batch)
        except BaseException:
            # release anyone still waiting on this step: no more work, no reduction with them
            try:
                close_stream(self.store, by="error")
                if not has(self.store, "group/0"):
                    self.store.set("group/0", json.dumps({"members": [CORE]}))
            except Exception:
                pass
            raise

    def _compute(self, stats: StepStats, state: StreamState, index: int) -> None:
        worker = self.coordinator.core.worker
        sequence = self.cache.sequence(state, index)
        stats.add(worker.accumulate(sequence, self.normalizer, index, self.version))

    def _silent(self, sid: int, now: float) -> bool:
        """No heartbeat from satellite ``sid`` for longer than dead_after_s."""
        self._first_seen.setdefault(sid, now)
        beat = float(self.store.get(f"hb/{sid}")) if has(self.store, f"hb/{sid}") else self._first_seen[sid]
        return now - beat > self.config.dead_after_s

    def _evict_dead(self, stats: StepStats) -> None:
        """While the step streams: a satellite found dead is evicted (whatever it says later is
        ignored) and what it claimed is recomputed now, so its death does not land on the tail."""
        store, now = self.store, time.time()
        for sid in range(1, store.add("joined", 0) + 1):
            if sid in self.evicted or not has(store, f"active/{sid}"):
                continue
            if has(store, f"finished/{sid}") or has(store, f"left/{sid}") or not self._silent(sid, now):
                continue
            store.set(f"evicted/{sid}", "1")
            self.evicted.add(sid)
            upto = claimed(store)
            state = read_state(store)  # read after ``upto``: it holds every micro-batch claimed so far
            for index in range(upto):
                owner = store.get(f"owner/{index}") if has(store, f"owner/{index}") else None
                if owner is not None and int(owner) == sid and index not in self.recomputed:
                    self._compute(stats, state, index)
                    self.recomputed.append(index)

    def _wait_for_ranks(self) -> None:
        """Until the core's other ranks have joined (they hold the weights: it takes milliseconds), so
        each computes a share of even a small step; one that has not joined within the world's
        timeout finds the work taken and is still exact."""
        if not self.ranks_invited:
            return
        deadline = time.monotonic() + self.coordinator.core.world.timeout_s
        while self.store.add("joined", 0) < self.ranks_invited and time.monotonic() < deadline:
            time.sleep(self.config.poll_s)

    def _train(self, pace_s: float, on_micro_batch: Callable[[int], None] | None) -> StepReport:
        store, core, config = self.store, self.coordinator.core, self.config
        worker = core.worker
        self._wait_for_ranks()
        stats = StepStats()
        waited, idle = 0.0, Idle(config)
        next_check = time.time() + 2 * config.heartbeat_s
        while True:
            if time.time() >= next_check:
                self._evict_dead(stats)
                next_check = time.time() + 2 * config.heartbeat_s
            state = read_state(store)
            if state.closure is None and self.deadline is not None and time.time() >= self.deadline:
                state = close_stream(store, by="deadline")
            index = try_claim(store, CORE, state.total)
            if index is None:
                if state.closure is not None:
                    break
                if self.deadline is not None:  # sleep past the deadline by at most one first poll
                    idle.next = min(idle.next, max(self.deadline - time.time(), config.poll_s))
                waited += idle.wait()
                continue
            idle.busy()
            store.set(f"owner/{index}", str(CORE))
            self._compute(stats, state, index)
            if on_micro_batch:
                on_micro_batch(index)
            if pace_s:
                time.sleep(pace_s)
        drained = time.perf_counter()
        closure, n = state.closure, state.total

        finished, left, dead = self._wait_for_satellites()
        recomputed = self.recomputed
        early = set(recomputed)
        for index in range(n):
            owner = int(store.get(f"owner/{index}")) if has(store, f"owner/{index}") else None
            if (owner is None or owner in dead) and index not in early:
                self._compute(stats, state, index)
                recomputed.append(index)
        by_participant = {CORE: list(stats.micro_batches)}
        for sid, record in finished.items():
            if record["micro_batches"]:
                by_participant[sid] = record["micro_batches"]
        members = [CORE, *sorted(sid for sid in finished if finished[sid]["micro_batches"])]
        for sid, record in sorted(left.items()):  # gradient sums handed over by satellites that left
            by_participant[sid] = record["micro_batches"]
            if record["grad"]:
                worker.grad += read_weights(record["grad"])[0]["grad"]
                remove_file(record["grad"])
            stats.add(stats_from_record(record))
        own_grad = worker.grad.clone()
        attempt = 0
        store.set("group/0", json.dumps({"members": members}))
        try:
            if len(members) == 1:
                grad, merged = worker.grad, stats
            else:
                grad, merged = reduce_sums(
                    store, 0, 0, len(members), worker.grad, stats, config.reduce_timeout_s, config.address
                )
        except Exception:
            # a member died inside the reduction: go on alone, redoing every other member's share
            attempt = 1
            worker.grad.copy_(own_grad)
            for sid in members[1:]:
                for index in by_participant.pop(sid):
                    self._compute(stats, state, index)
                    by_participant[CORE].append(index)
                    recomputed.append(index)
            dead = sorted(set(dead) | set(members[1:]))
            members = [CORE]
            store.set("group/1", json.dumps({"members": members}))
            grad, merged = worker.grad, stats
        reduced = time.perf_counter()
        merged.micro_batches = sorted(i for ids in by_participant.values() for i in ids)
        if merged.micro_batches != list(range(n)):
            raise RuntimeError(
                f"step {self.step}: micro-batches used {merged.micro_batches}, expected each of 0..{n - 1} once"
            )
        trained = n > 0
        if trained:
            if self.normalizer is None:
                grad = grad / closure.n_executions  # fp64, once, after the sum
                merged.loss /= closure.n_executions
            elif closure.n_executions != self.normalizer:  # closed with another count than announced
                grad = grad * (self.normalizer / closure.n_executions)
                merged.loss *= self.normalizer / closure.n_executions
            grad_norm = core.apply(grad, new_version=self.final)
        else:  # nothing arrived: the same weights become the next version (engines/train/run.py)
            if self.final:
                core.step += 1
                core.version += 1
            grad_norm = 0.0
        store.set("done", str(core.version))
        applied = time.perf_counter()
        wait_s = {CORE: waited} | {sid: r["wait_s"] for sid, r in (finished | left).items()}
        return StepReport(
            step=self.step,
            version=core.version,
            micro_batches=n,
            members=members,
            by_participant=by_participant,
            recomputed=recomputed,
            dead=sorted(dead),
            stats=merged,
            grad_norm=grad_norm,
            reduce_attempts=attempt + 1,
            timings={
                "publish": self._published - self._started,
                "compute": drained - self._published,
                "closed_after": closure.t - self.opened_at,
                "wait_and_recompute": reduced - drained,
                "apply": applied - reduced,
                "step": applied - self._started,
            },
            n_executions=closure.n_executions,
            trained=trained,
            closed_by=closure.by,
            left=sorted(left),
            arrivals_s=[t - self.opened_at for t in state.arrivals()],
            wait_s=wait_s,
            recomputed_early=sorted(early),
        )

    def _wait_for_satellites(self) -> tuple[dict[int, dict], dict[int, dict], list[int]]:
        """Waits until every active satellite has finished, left or died. A satellite that is not
        active yet (still pulling weights) can own nothing: every micro-batch is claimed already."""
        store, idle = self.store, Idle(self.config)
        while True:
            joined = store.add("joined", 0)
            finished, left, dead, waiting = {}, {}, [], []
            now = time.time()
            for sid in range(1, joined + 1):
                if sid in self.evicted:
                    dead.append(sid)
                elif has(store, f"finished/{sid}"):
                    finished[sid] = json.loads(store.get(f"finished/{sid}"))
                elif has(store, f"left/{sid}"):
                    left[sid] = json.loads(store.get(f"left/{sid}"))
                elif has(store, f"active/{sid}"):
                    (dead if self._silent(sid, now) else waiting).append(sid)
            if not waiting:
                for sid in self.evicted:  # an evicted satellite that left anyway: its sum is void
                    record = json.loads(store.get(f"left/{sid}")) if has(store, f"left/{sid}") else {}
                    if record.get("grad"):
                        remove_file(record["grad"])
                return finished, left, dead
            idle.wait()
