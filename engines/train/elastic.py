"""Elastic data parallel: satellites join a training step that is already running.

One step, as the core cell runs it (``ElasticCoordinator.run_step``):

1. The core publishes the step's weights to the fast in-host path and opens the step on a
   long-lived TCPStore: ``meta`` = {version, number of micro-batches, where they and the weights are}.
2. Everyone (the core is participant 0) claims micro-batches from one atomic counter and adds
   their gradients to a local flat buffer. A satellite may join at any moment: it takes a
   participant id, pulls the weights (version-checked), and claims what is left; so everyone
   finishes together.
3. When the counter runs out the core waits until every satellite that joined has finished or
   died (heartbeats). Micro-batches claimed by a dead satellite died with its gradient buffer, so
   the core computes them again: every micro-batch counts exactly once.
4. The core names the members (itself + finished satellites); they form a gloo group for this
   step from the TCPStore plus a PrefixStore and reduce their gradient sums once. If that reduction
   fails (a member died inside it), the core restores its own sum, recomputes every other
   member's micro-batches and goes on alone: slower, still exact.
5. The core applies the summed gradient (CoreTrainer.apply): a new policy version.

The update equals single-process training on the same batch, whatever the number of satellites
and whenever they join (up to the order of floating-point additions).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from engines.model.weights import read_weights, save_weights
from engines.train.core import CoreTrainer
from engines.train.worker import GradWorker, StepStats
from trajectory_store.processor import PackedSequence

CORE = 0


@dataclass
class ElasticConfig:
    """Timing of the step protocol."""

    heartbeat_s: float = 0.2  # how often a satellite says it is alive
    dead_after_s: float = 5.0  # a satellite silent for this long is dead
    reduce_timeout_s: float = 60.0  # a gloo reduction that takes longer has failed
    join_timeout_s: float = 600.0  # how long a satellite waits for a step to open


@dataclass
class StepReport:
    step: int
    version: int  # the policy version after the step
    micro_batches: int
    members: list[int]  # participants whose gradients were reduced (0 = the core)
    by_participant: dict[int, list[int]]  # micro-batches each member contributed
    recomputed: list[int]  # micro-batches the core redid for satellites that died
    dead: list[int]
    stats: StepStats
    grad_norm: float
    reduce_attempts: int
    timings: dict[str, float] = field(default_factory=dict)

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
            **{f"{k}_s": v for k, v in self.timings.items()},
        }


def step_store(store: dist.Store, step: int) -> dist.Store:
    return dist.PrefixStore(f"gyre/step{step}/", store)


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
    ) -> StepReport:
        """One elastic step over ``sequences`` (also readable by satellites at ``batch_uri``).

        ``pace_s`` slows the core down per micro-batch (tests and benchmarks use it so that
        satellites have something left to take)."""
        started = time.perf_counter()
        store = step_store(self.store, step)
        core = self.core
        weights_path = f"{weights_dir}/step{step}-v{core.version}.safetensors"
        save_weights(core.engine.module.state_dict(), weights_path, core.version)
        core.sync_worker()
        worker = core.worker
        worker.reset()
        n = len(sequences)
        store.set(
            "meta",
            json.dumps(
                {
                    "step": step,
                    "version": core.version,
                    "micro_batches": n,
                    "n_executions": n_executions,
                    "batch_uri": batch_uri,
                    "weights": weights_path,
                }
            ),
        )
        opened = time.perf_counter()
        stats = StepStats()
        while (index := store.add("claim", 1) - 1) < n:
            store.set(f"owner/{index}", str(CORE))
            stats.add(worker.accumulate(sequences[index], n_executions, index, core.version))
            if on_micro_batch:
                on_micro_batch(index)
            if pace_s:
                time.sleep(pace_s)
        computed = time.perf_counter()

        finished, dead = self._wait_for_satellites(store)
        recomputed = []
        for index in range(n):
            owner = int(store.get(f"owner/{index}")) if _has(store, f"owner/{index}") else None
            if owner is None or owner in dead:
                stats.add(worker.accumulate(sequences[index], n_executions, index, core.version))
                recomputed.append(index)
        members = [CORE, *sorted(finished)]
        by_participant = {CORE: list(stats.micro_batches)}
        for sid in finished:
            by_participant[sid] = json.loads(store.get(f"finished/{sid}"))["micro_batches"]
        own_grad = worker.grad.clone()
        attempt = 0
        store.set("group/0", json.dumps({"members": members}))
        try:
            grad, merged = _reduce(
                store, 0, 0, len(members), worker.grad, stats, self.config.reduce_timeout_s
            )
        except Exception:
            # a member died inside the reduction: go on alone, redoing every other member's share
            attempt = 1
            worker.grad.copy_(own_grad)
            for sid in finished:
                for index in by_participant.pop(sid):
                    stats.add(worker.accumulate(sequences[index], n_executions, index, core.version))
                    recomputed.append(index)
            dead = sorted(set(dead) | set(finished))
            members = [CORE]
            by_participant[CORE] = list(stats.micro_batches)
            store.set("group/1", json.dumps({"members": members}))
            grad, merged = worker.grad, stats
        reduced = time.perf_counter()
        merged.micro_batches = sorted(i for ids in by_participant.values() for i in ids)
        if merged.micro_batches != list(range(n)):
            raise RuntimeError(
                f"step {step}: micro-batches used {merged.micro_batches}, expected each of 0..{n - 1} once"
            )
        grad_norm = core.apply(grad)
        store.set("done", str(core.version))
        applied = time.perf_counter()
        return StepReport(
            step=step,
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
                "publish": opened - started,
                "compute": computed - opened,
                "wait_and_recompute": reduced - computed,
                "apply": applied - reduced,
                "step": applied - started,
            },
        )

    def _wait_for_satellites(self, store: dist.Store) -> tuple[list[int], list[int]]:
        first_seen: dict[int, float] = {}
        while True:
            joined = store.add("joined", 0)
            finished, dead, waiting = [], [], []
            now = time.time()
            for sid in range(1, joined + 1):
                if _has(store, f"finished/{sid}"):
                    finished.append(sid)
                    continue
                first_seen.setdefault(sid, now)
                beat = float(store.get(f"hb/{sid}")) if _has(store, f"hb/{sid}") else first_seen[sid]
                if now - beat > self.config.dead_after_s:
                    dead.append(sid)
                else:
                    waiting.append(sid)
            if not waiting:
                return finished, dead
            time.sleep(0.01)

    def close(self) -> None:
        del self.store


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
) -> dict:
    """A satellite's share of one step. Test and benchmark hooks: ``join_when`` delays joining
    ("after half the micro-batches"), ``die_after`` ends the process abruptly after that many
    micro-batches, ``pace_s`` slows each micro-batch down, ``ready`` is called once connected."""
    import os

    config = config or ElasticConfig()
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.join_timeout_s))
    store = step_store(client, step)
    if ready is not None:
        ready()
    meta = json.loads(store.get("meta"))
    while join_when is not None and not join_when(store):
        time.sleep(0.005)
    sid = store.add("joined", 1)
    heartbeat = _Heartbeat(store, f"hb/{sid}", config.heartbeat_s)
    try:
        pulled = time.perf_counter()
        state, version = read_weights(meta["weights"], expected_version=meta["version"])
        worker.load_weights(state, version)
        pull_s = time.perf_counter() - pulled
        sequences = load_batch(meta["batch_uri"])
        worker.reset()
        stats = StepStats()
        while (index := store.add("claim", 1) - 1) < meta["micro_batches"]:
            store.set(f"owner/{index}", str(sid))
            stats.add(worker.accumulate(sequences[index], meta["n_executions"], index, meta["version"]))
            if die_after is not None and len(stats.micro_batches) >= die_after:
                os._exit(17)  # a crash mid-step, as a killed cell would
            if pace_s:
                time.sleep(pace_s)
        store.set(f"finished/{sid}", json.dumps({"micro_batches": stats.micro_batches}))
        group = json.loads(store.get("group/0"))
        if sid not in group["members"]:
            return {"sid": sid, "member": False, "micro_batches": stats.micro_batches, "pull_s": pull_s}
        rank = group["members"].index(sid)
        _reduce(store, 0, rank, len(group["members"]), worker.grad, stats, config.reduce_timeout_s)
        return {"sid": sid, "member": True, "micro_batches": stats.micro_batches, "pull_s": pull_s}
    finally:
        heartbeat.stop()
