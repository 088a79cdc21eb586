"""What the core and the satellites of an elastic step share (engines/train/elastic.py has the protocol):
the step's timing (ElasticConfig), the participant id of the core (CORE), the idle participant's
backoff (Idle), a satellite's heartbeat (Heartbeat), the one gloo reduction of gradient sums
(reduce_sums) and the stats records a satellite leaves on the store.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engines.train.worker import StepStats

CORE = 0


@dataclass
class ElasticConfig:
    """Timing of the step protocol."""

    heartbeat_s: float = 0.2  # how often a satellite says it is alive
    dead_after_s: float = 5.0  # a satellite silent for this long is dead
    reduce_timeout_s: float = 60.0  # a gloo reduction that takes longer has failed
    join_timeout_s: float = 600.0  # how long a satellite waits for a step to open
    poll_s: float = 0.01  # an idle participant's first wait for a new micro-batch (the core: its deadline)
    idle_max_s: float = 0.05  # ... doubling while nothing arrives, up to this (each look costs CPU)
    # the address the other participants reach this process by in the gloo reduction (its host's
    # address on the cluster network); None: torch's default (GLOO_SOCKET_IFNAME, else the address
    # the host's name resolves to, which on a host with several networks may be the wrong one)
    address: str | None = None


def has(store: dist.Store, key: str) -> bool:
    return store.check([key])


def reduce_sums(
    store: dist.Store,
    attempt: int,
    rank: int,
    size: int,
    grad: torch.Tensor,
    stats: StepStats,
    timeout_s: float,
    address: str | None = None,
) -> tuple[torch.Tensor, StepStats]:
    """One gloo all-reduce of [grad sums | stat sums] and one of the maxima, in a group made for it;
    this process takes part from ``address`` (ElasticConfig.address)."""
    prefixed = dist.PrefixStore(f"reduce{attempt}/", store)
    if address is None:
        group = dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout_s))
    else:
        options = dist.ProcessGroupGloo._Options()  # torch's own way to pick a device (distributed_c10d)
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        group = dist.ProcessGroupGloo(prefixed, rank, size, options)
    flat = torch.cat([grad, torch.tensor(stats.as_vector(), dtype=grad.dtype)])
    group.allreduce([flat]).wait()
    maxima = torch.tensor([stats.ratio_max, float(stats.lag_max)], dtype=torch.float32)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    group.allreduce([maxima], options).wait()
    n = grad.numel()
    merged = StepStats.from_vector(flat[n:].tolist(), float(maxima[0]), int(maxima[1]), stats.micro_batches)
    return flat[:n], merged


def stats_record(stats: StepStats) -> dict:
    return {
        "micro_batches": stats.micro_batches,
        "vector": stats.as_vector(),
        "ratio_max": stats.ratio_max,
        "lag_max": stats.lag_max,
    }


def stats_from_record(record: dict) -> StepStats:
    return StepStats.from_vector(
        record["vector"], record["ratio_max"], record["lag_max"], record["micro_batches"]
    )


class Idle:
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


class Heartbeat:
    """A satellite's "alive" on the store, every ``every_s`` from a thread of its own."""

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
