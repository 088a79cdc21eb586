"""Elastic data parallel: satellites join a training step that is already running, and the step's
micro-batches may still be arriving (a streaming step).

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
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from engines.model.weights import read_weights, save_weights
from engines.train.core import CoreTrainer
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
from engines.train.worker import GradWorker, StepStats
from trajectory_store.processor import PackedSequence

CORE = 0

__all__ = [
    "CORE",
    "ElasticConfig",
    "ElasticCoordinator",
    "StepReport",
    "StreamingStep",
    "run_satellite",
    "step_store",
]


@dataclass
class ElasticConfig:
    """Timing of the step protocol."""

    heartbeat_s: float = 0.2  # how often a satellite says it is alive
    dead_after_s: float = 5.0  # a satellite silent for this long is dead
    reduce_timeout_s: float = 60.0  # a gloo reduction that takes longer has failed
    join_timeout_s: float = 600.0  # how long a satellite waits for a step to open
    poll_s: float = 0.01  # an idle participant's first wait for a new micro-batch (the core: its deadline)
    idle_max_s: float = 0.05  # ... doubling while nothing arrives, up to this (each look costs CPU)


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
            "last_arrival_s": max(self.arrivals_s, default=0.0),
            "core_wait_s": self.wait_s.get(CORE, 0.0),
            **{f"{k}_s": v for k, v in self.timings.items()},
        }


def _has(store: dist.Store, key: str) -> bool:
    return store.check([key])


def _reduce(
    store: dist.Store,
    attempt: int,
    rank: int,
    size: int,
    grad: torch.Tensor,
    stats: StepStats,
    timeout_s: float,
) -> tuple[torch.Tensor, StepStats]:
    """One gloo all-reduce of [grad sums | stat sums] and one of the maxima, in a group made for it."""
    group = dist.ProcessGroupGloo(
        dist.PrefixStore(f"reduce{attempt}/", store), rank, size, timedelta(seconds=timeout_s)
    )
    flat = torch.cat([grad, torch.tensor(stats.as_vector(), dtype=grad.dtype)])
    group.allreduce([flat]).wait()
    maxima = torch.tensor([stats.ratio_max, float(stats.lag_max)], dtype=torch.float32)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([maxima], options).wait()
    n = grad.numel()
    merged = StepStats.from_vector(flat[n:].tolist(), float(maxima[0]), int(maxima[1]), stats.micro_batches)
    return flat[:n], merged


def _stats_record(stats: StepStats) -> dict:
    return {
        "micro_batches": stats.micro_batches,
        "vector": stats.as_vector(),
        "ratio_max": stats.ratio_max,
        "lag_max": stats.lag_max,
    }


def _stats_from_record(record: dict) -> StepStats:
    return StepStats.from_vector(
        record["vector"], record["ratio_max"], record["lag_max"], record["micro_batches"]
    )


class _Idle:
    """The wait between an idle participant's looks at the store: ``poll_s``, doubling while nothing
    arrives up to ``idle_max_s``, back to ``poll_s`` once something did. Each look is two or three
    TCPStore round trips and a JSON parse; at a constant 10 ms an idle participant took about four
    times the CPU it takes with this backoff (`python -m bench.idle`), CPU a small machine takes from
    the engines decoding beside it. A satellite asked to leave notices within one wait."""

    def __init__(self, config: ElasticConfig):
        self.first, self.most = config.poll_s, max(config.idle_max_s, config.poll_s)
        self.next = self.first

    def wait(self) -> float:
        """Sleeps once; the seconds slept."""
        started = time.perf_counter()
        time.sleep(self.next)
        self.next = min(self.next * 2, self.most)
        return time.perf_counter() - started

    def busy(self) -> None:
        self.next = self.first


class _Heartbeat:
    def __init__(self, store: dist.Store, key: str, every_s: float):
        self.store, self.key, self.every_s = store, key, every_s
        self._stop = threading.Event()
        store.set(key, str(time.time()))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.store.set(self.key, str(time.time()))
            except Exception:  # the core went away: nothing left to tell
                return

    def stop(self) -> None:
        self._stop.set()


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
    ) -> StreamingStep:
        """Opens a step whose micro-batches will arrive later (``StreamingStep``). ``n_executions``,
        when known now, is the normalizer (then each micro-batch is divided by it, as run_step
        does); ``deadline_s`` after opening, the core closes the step with what has arrived.
        ``final`` False: the update is one of several of the step (TrainerConfig.mini_batches), and
        makes no new version."""
        return StreamingStep(self, step, weights_dir, n_executions, deadline_s, final)

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
    ) -> StepReport:
        """One elastic step over ``sequences`` (also readable by satellites at ``batch_uri``): a
        streaming step whose batch is one chunk, closed at once.

        ``pace_s`` slows the core down per micro-batch (tests and benchmarks use it so that
        satellites have something left to take); ``final`` as in ``open_step``."""
        opened = self.open_step(step, weights_dir=weights_dir, n_executions=n_executions, final=final)
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
    ):
        started = time.perf_counter()
        self.coordinator, self.config, self.step, self.final = coordinator, coordinator.config, step, final
        self.store = step_store(coordinator.store, step)
        if _has(self.store, "meta"):
            raise ValueError(f"step {step} was already opened on this store")
        if n_executions is not None and n_executions < 1:
            raise ValueError(f"a normalizer known at open must be >= 1, got {n_executions}")
        core = coordinator.core
        self.normalizer = n_executions  # None: applied to the reduced sum (a streaming step)
        weights_path = f"{weights_dir}/step{step}-v{core.version}.safetensors"
        save_weights(core.engine.module.state_dict(), weights_path, core.version)
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
                    "weights": weights_path,
                    "handoff_dir": weights_dir,
                    "opened_at": self.opened_at,
                }
            ),
        )
        self._started = started
        self._published = time.perf_counter()

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
                if not _has(self.store, "group/0"):
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
        beat = float(self.store.get(f"hb/{sid}")) if _has(self.store, f"hb/{sid}") else self._first_seen[sid]
        return now - beat > self.config.dead_after_s

    def _evict_dead(self, stats: StepStats) -> None:
        """While the step streams: a satellite found dead is evicted (whatever it says later is
        ignored) and what it claimed is recomputed now, so its death does not land on the tail."""
        store, now = self.store, time.time()
        for sid in range(1, store.add("joined", 0) + 1):
            if sid in self.evicted or not _has(store, f"active/{sid}"):
                continue
            if _has(store, f"finished/{sid}") or _has(store, f"left/{sid}") or not self._silent(sid, now):
                continue
            store.set(f"evicted/{sid}", "1")
            self.evicted.add(sid)
            upto = claimed(store)
            state = read_state(store)  # read after ``upto``: it holds every micro-batch claimed so far
            for index in range(upto):
                owner = store.get(f"owner/{index}") if _has(store, f"owner/{index}") else None
                if owner is not None and int(owner) == sid and index not in self.recomputed:
                    self._compute(stats, state, index)
                    self.recomputed.append(index)

    def _train(self, pace_s: float, on_micro_batch: Callable[[int], None] | None) -> StepReport:
        store, core, config = self.store, self.coordinator.core, self.config
        worker = core.worker
        stats = StepStats()
        waited, idle = 0.0, _Idle(config)
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
            owner = int(store.get(f"owner/{index}")) if _has(store, f"owner/{index}") else None
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
                worker.grad += load_file(record["grad"])["grad"]
                os.remove(record["grad"])
            stats.add(_stats_from_record(record))
        own_grad = worker.grad.clone()
        attempt = 0
        store.set("group/0", json.dumps({"members": members}))
        try:
            if len(members) == 1:
                grad, merged = worker.grad, stats
            else:
                grad, merged = _reduce(store, 0, 0, len(members), worker.grad, stats, config.reduce_timeout_s)
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
        store, idle = self.store, _Idle(self.config)
        while True:
            joined = store.add("joined", 0)
            finished, left, dead, waiting = {}, {}, [], []
            now = time.time()
            for sid in range(1, joined + 1):
                if sid in self.evicted:
                    dead.append(sid)
                elif _has(store, f"finished/{sid}"):
                    finished[sid] = json.loads(store.get(f"finished/{sid}"))
                elif _has(store, f"left/{sid}"):
                    left[sid] = json.loads(store.get(f"left/{sid}"))
                elif _has(store, f"active/{sid}"):
                    (dead if self._silent(sid, now) else waiting).append(sid)
            if not waiting:
                for sid in self.evicted:  # an evicted satellite that left anyway: its sum is void
                    record = json.loads(store.get(f"left/{sid}")) if _has(store, f"left/{sid}") else {}
                    if record.get("grad") and os.path.exists(record["grad"]):
                        os.remove(record["grad"])
                return finished, left, dead
            idle.wait()


def _hand_over(
    store: dist.Store, sid: int, worker: GradWorker, stats: StepStats, meta: dict, wait_s: float
) -> None:
    """A leaving satellite's gradient sum goes to a file the core adds (fp64, so still exact)."""
    path = None
    if stats.micro_batches:
        path = os.path.join(meta["handoff_dir"], f"step{meta['step']}-satellite{sid}.grad.safetensors")
        tmp = f"{path}.tmp-{os.getpid()}"
        save_file({"grad": worker.grad}, tmp)
        os.replace(tmp, path)
    store.set(f"left/{sid}", json.dumps({**_stats_record(stats), "grad": path, "wait_s": wait_s}))


def run_satellite(
    host: str,
    port: int,
    step: int,
    worker: GradWorker,
    load_batch: Callable[[str], list[PackedSequence]],
    *,
    config: ElasticConfig | None = None,
    join_when: Callable[[dist.Store], bool] | None = None,
    die_after: int | None = None,
    pace_s: float = 0.0,
    ready: Callable[[], None] | None = None,
    leave: Callable[[], bool] | None = None,
    leave_after: int | None = None,
    joined: Callable[[dict], None] | None = None,
) -> dict:
    """A satellite's share of one step. ``leave`` is asked between micro-batches and while idle:
    True hands the gradient sum over to the core and returns at once (the cell can serve rollouts).

    Test and benchmark hooks: ``join_when`` delays joining ("after half the micro-batches"),
    ``die_after`` ends the process abruptly after that many micro-batches, ``leave_after`` leaves
    after that many, ``pace_s`` slows each micro-batch down, ``ready`` is called once connected.
    ``joined`` is called with {sid, pull_s} once the weights are pulled and the core counts on this
    satellite (the end of a cell's switch to training: scheduler/cells.py times it)."""
    config = config or ElasticConfig()
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.join_timeout_s))
    store = step_store(client, step)
    if ready is not None:
        ready()
    meta = json.loads(store.get("meta"))
    while join_when is not None and not join_when(store):
        time.sleep(0.005)
    state = read_state(store)
    if state.closure is not None and claimed(store) >= state.total:
        return {"sid": None, "member": False, "late": True, "micro_batches": []}
    sid = store.add("joined", 1)
    heartbeat = _Heartbeat(store, f"hb/{sid}", config.heartbeat_s)
    try:
        pulled = time.perf_counter()
        weights, version = read_weights(meta["weights"], expected_version=meta["version"])
        worker.load_weights(weights, version)
        pull_s = time.perf_counter() - pulled
        cache = ChunkCache(load_batch)
        worker.reset()
        stats = StepStats()
        waited, idle = 0.0, _Idle(config)
        result = {"sid": sid, "pull_s": pull_s}
        store.set(f"active/{sid}", "1")  # from here on the core waits for this satellite
        if joined is not None:
            joined(dict(result))
        while True:
            if _has(store, f"evicted/{sid}"):  # found dead by the core (a long stall): its work is redone
                return result | {"member": False, "evicted": True, "micro_batches": stats.micro_batches}
            if (leave is not None and leave()) or (
                leave_after is not None and len(stats.micro_batches) >= leave_after
            ):
                asked = time.perf_counter()
                _hand_over(store, sid, worker, stats, meta, waited)
                return result | {
                    "member": False,
                    "left": True,
                    "micro_batches": stats.micro_batches,
                    "handoff_s": time.perf_counter() - asked,
                    "left_after_s": time.time() - meta["opened_at"],
                    "wait_s": waited,
                }
            state = read_state(store)
            index = try_claim(store, sid, state.total)
            if index is None:
                if state.closure is not None:
                    break
                waited += idle.wait()
                continue
            idle.busy()
            store.set(f"owner/{index}", str(sid))
            stats.add(worker.accumulate(cache.sequence(state, index), meta["n_executions"], index, version))
            if die_after is not None and len(stats.micro_batches) >= die_after:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-step: a killed cell, at a known point
            if pace_s:
                time.sleep(pace_s)
        store.set(f"finished/{sid}", json.dumps({"micro_batches": stats.micro_batches, "wait_s": waited}))
        result |= {"micro_batches": stats.micro_batches, "wait_s": waited, "left": False}
        group = json.loads(store.get("group/0"))
        if sid not in group["members"]:
            return result | {"member": False}
        rank = group["members"].index(sid)
        _reduce(store, 0, rank, len(group["members"]), worker.grad, stats, config.reduce_timeout_s)
        return result | {"member": True}
    finally:
        heartbeat.stop()
