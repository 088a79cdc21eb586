"""The queue of one streaming step: micro-batches that arrive over time, on the step's TCPStore.

A step is opened by the core (elastic.py) before its micro-batches are known. A producer (the
campaign, as groups of executions finish and are packed) appends **chunks**: one Parquet file of
one or more packed sequences (trajectory_store.processor.batch_to_table), each sequence one
micro-batch, numbered globally in arrival order. The producer finally closes the step with the
number of executions (the loss normalizer), or the core closes it at its deadline with what has
arrived. Train participants (the core and any satellites) claim micro-batches as they arrive.

Why a chunk per append rather than a file per micro-batch: the processor packs a finished group
(or several) into several sequences at once and writes them as one object, so one append is one
whole, idempotent write keyed by what it holds (its group ids); the non-streaming step is simply one
chunk (its batch_uri, as before); a participant reads a chunk once and caches it. The price: a
participant that claims one sequence of a chunk reads the whole chunk (a group's worth, small).

Keys, under the step's prefix ``gyre/step<n>/`` (``step_store``):

    stream       JSON StreamState: the chunks so far and, once closed, the closure. Every change is
                 a compare-and-set of the whole value, so an append and a close never interleave:
                 an append lands before the close or raises StepClosed (then its executions belong
                 to a later step).
    next         "<claimed>:<who>": how many micro-batches have been claimed. Participant ``who``
                 claims micro-batch k by swapping "k:x" for "k+1:who", and only while k < arrived,
                 so nobody ever holds a claim on a micro-batch that has not arrived: a participant
                 can leave, or be found dead, without orphaning future work.
    owner/<k>    who claimed micro-batch k (written right after the claim; a claim whose owner is
                 missing or dead is recomputed by the core).

elastic.py adds the participant keys (joined, active/<sid>, hb/<sid>, finished/<sid>, left/<sid>,
group/<attempt>, done).
"""

from __future__ import annotations

import bisect
import io
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Literal

import fsspec
import pyarrow.parquet as pq
import torch.distributed as dist

from trajectory_store.processor import PackedBatch, PackedSequence, batch_to_table, table_to_sequences

ClosedBy = Literal["producer", "deadline", "error"]


class StepClosed(RuntimeError):
    """The step was closed before this append landed: its executions were not trained in it."""


def step_store(store: dist.Store, step: int) -> dist.Store:
    return dist.PrefixStore(f"gyre/step{step}/", store)


@dataclass(frozen=True)
class Chunk:
    key: str  # the producer's idempotency key (default: the uri)
    uri: str  # Parquet file of packed sequences, readable by every participant
    first: int  # global index of its first micro-batch
    count: int  # micro-batches (packed sequences) in it
    n_executions: int  # executions whose trees it holds (their sum normalizes a deadline close)
    t: float  # wall-clock time it was appended (time.time())


@dataclass(frozen=True)
class Closure:
    by: ClosedBy
    n_executions: int  # the step's loss normalizer
    t: float  # wall-clock time of the close


@dataclass
class StreamState:
    chunks: list[Chunk] = field(default_factory=list)
    closure: Closure | None = None

    @property
    def total(self) -> int:
        """Micro-batches arrived so far (all of the step's once closed)."""
        return self.chunks[-1].first + self.chunks[-1].count if self.chunks else 0

    @property
    def n_executions(self) -> int:
        return sum(c.n_executions for c in self.chunks)

    def chunk_of(self, index: int) -> Chunk:
        if not 0 <= index < self.total:
            raise IndexError(f"micro-batch {index} has not arrived ({self.total} so far)")
        firsts = [c.first for c in self.chunks if c.count]
        chunks = [c for c in self.chunks if c.count]
        return chunks[bisect.bisect_right(firsts, index) - 1]

    def arrivals(self) -> list[float]:
        """Wall-clock arrival time of each micro-batch, by index."""
        return [c.t for c in self.chunks for _ in range(c.count)]

    def to_json(self) -> str:
        return json.dumps(
            {
                "chunks": [asdict(c) for c in self.chunks],
                "closure": asdict(self.closure) if self.closure else None,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> StreamState:
        data = json.loads(raw)
        closure = data["closure"]
        return cls([Chunk(**c) for c in data["chunks"]], Closure(**closure) if closure else None)


# -- the stream's state: read, change atomically -------------------------------------------------
def open_stream(store: dist.Store) -> None:
    store.set("stream", StreamState().to_json())
    store.set("next", "0:-")


def read_state(store: dist.Store) -> StreamState:
    return StreamState.from_json(store.get("stream"))


def _change(store: dist.Store, change: Callable[[StreamState], StreamState | None]) -> StreamState:
    """Compare-and-set loop on the whole state; ``change`` returns None for "already so"."""
    while True:
        raw = store.get("stream").decode()
        state = StreamState.from_json(raw)
        new = change(state)
        if new is None:
            return state
        desired = new.to_json()
        if store.compare_set("stream", raw, desired) == desired.encode():
            return new


def append_chunk(
    store: dist.Store, uri: str, n_sequences: int, n_executions: int, key: str | None = None
) -> Chunk:
    """Makes ``n_sequences`` micro-batches (the sequences of the Parquet file at ``uri``) claimable.

    Idempotent by ``key``: appending a key again returns the chunk already there."""
    if n_sequences < 0 or n_executions < 0:
        raise ValueError(f"a chunk needs counts >= 0, got {n_sequences} sequences, {n_executions} executions")
    if n_sequences and not n_executions:
        raise ValueError(
            f"{uri}: {n_sequences} sequences from 0 executions; say how many executions it holds"
        )
    key = key or uri
    appended: list[Chunk] = []

    def add(state: StreamState) -> StreamState | None:
        for chunk in state.chunks:
            if chunk.key == key:
                appended[:] = [chunk]
                return None
        if state.closure is not None:
            raise StepClosed(f"the step was closed ({state.closure.by}) before {key} arrived")
        chunk = Chunk(key, uri, state.total, n_sequences, n_executions, time.time())
        appended[:] = [chunk]
        return StreamState([*state.chunks, chunk], None)

    _change(store, add)
    return appended[0]


def close_stream(
    store: dist.Store, n_executions: int | None = None, by: ClosedBy = "producer"
) -> StreamState:
    """Closes the step: no more micro-batches. ``n_executions`` (default: the sum over its chunks) is
    the loss normalizer. Closing a closed step again is a no-op (it keeps the first closure)."""

    def close(state: StreamState) -> StreamState | None:
        if state.closure is not None:
            return None
        n = state.n_executions if n_executions is None else n_executions
        if by != "error" and state.total and n < 1:
            raise ValueError(f"{state.total} micro-batches need a normalizer >= 1 executions, got {n}")
        return StreamState(state.chunks, Closure(by, n, time.time()))

    return _change(store, close)


# -- claims -------------------------------------------------------------------------------------
def claimed(store: dist.Store) -> int:
    """How many micro-batches have been claimed so far."""
    return int(store.get("next").decode().split(":")[0])


def try_claim(store: dist.Store, who: int, arrived: int) -> int | None:
    """Claims the next micro-batch if one has arrived and is unclaimed; its index, or None."""
    while True:
        current = store.get("next").decode()
        index = int(current.split(":")[0])
        if index >= arrived:
            return None
        # "index+1:who" is unique to this claim (who holds one claim at a time, indices only grow),
        # so reading it back means this participant's swap is the one that happened
        desired = f"{index + 1}:{who}"
        if store.compare_set("next", current, desired) == desired.encode():
            return index


# -- chunks on storage --------------------------------------------------------------------------
def read_batch(uri: str) -> list[PackedSequence]:
    with fsspec.open(uri, "rb") as handle:
        return table_to_sequences(pq.read_table(io.BytesIO(handle.read())))


def write_chunk(sequences: Sequence[PackedSequence], uri: str, step: int = 0) -> str:
    """Writes packed sequences as one Parquet object (whole: readers only learn of it once appended)."""
    buffer = io.BytesIO()
    pq.write_table(batch_to_table(PackedBatch(list(sequences), {}), step), buffer)
    fs, path = fsspec.core.url_to_fs(uri)
    fs.makedirs(fs._parent(path), exist_ok=True)
    fs.pipe_file(path, buffer.getvalue())
    return uri


class ChunkCache:
    """A participant's view of the step's sequences: each chunk read once, on first claim."""

    def __init__(self, load: Callable[[str], list[PackedSequence]] = read_batch):
        self._load = load
        self._chunks: dict[str, list[PackedSequence]] = {}

    def put(self, key: str, sequences: list[PackedSequence]) -> None:
        self._chunks[key] = sequences

    def sequence(self, state: StreamState, index: int) -> PackedSequence:
        chunk = state.chunk_of(index)
        if chunk.key not in self._chunks:
            sequences = self._load(chunk.uri)
            if len(sequences) != chunk.count:
                raise ValueError(
                    f"{chunk.uri} holds {len(sequences)} sequences, its append said {chunk.count}"
                )
            self._chunks[chunk.key] = sequences
        return self._chunks[chunk.key][index - chunk.first]


class StreamProducer:
    """Appends to one open step and closes it, from any process that reaches the core's store:
    ``StreamProducer(host, port, step)``, then ``append_sequences(sequences, uri, n_executions,
    key=group_id)`` as groups are packed, then ``close()`` (or ``close(n_executions)``); the core may
    close the step at its deadline first, and a later append raises StepClosed."""

    def __init__(self, host: str, port: int, step: int, *, timeout_s: float = 600.0):
        self._client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.store = step_store(self._client, step)
        self.store.wait(["meta"])  # the core has opened the step

    def append(self, uri: str, n_sequences: int, n_executions: int, *, key: str | None = None) -> Chunk:
        return append_chunk(self.store, uri, n_sequences, n_executions, key)

    def append_sequences(
        self, sequences: Sequence[PackedSequence], uri: str, n_executions: int, *, key: str | None = None
    ) -> Chunk:
        write_chunk(sequences, uri)
        return self.append(uri, len(sequences), n_executions, key=key)

    def close(self, n_executions: int | None = None) -> StreamState:
        return close_stream(self.store, n_executions)

    def state(self) -> StreamState:
        return read_state(self.store)
