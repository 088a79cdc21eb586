"""Streaming steps on real processes: micro-batches arrive over time (with a lull), satellites join,
die and leave mid-stream, the step closes by its producer, at its deadline, or empty.

Standards (engines/train/elastic.py says why):
- a streaming step equals the non-streaming run_step on the same micro-batches: its gradient within
  1e-6 relative (the normalizer divides the fp64 sum once instead of each micro-batch's fp32 loss),
  its parameter update within the elastic tests' 1e-4 (Adam's first step divides each gradient
  element by its own magnitude, so the ~1e-7 rounding differences of elements that are cancellation
  residues become 5e-6 to 1.4e-5 of the update, depending on the machine's kernels; a micro-batch
  lost or counted twice changes the gradient by about 1 / micro-batches, which the 1e-6 catches);
- a streaming step with satellites equals the same streaming step of the core alone bit for bit,
  whoever computed which micro-batch, and whoever died or left."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from engines.train.config import LossConfig
from engines.train.core import CoreTrainer
from engines.train.elastic import ElasticCoordinator
from engines.train.elastic_protocol import ElasticConfig
from engines.train.satellite import run_satellite, satellite_main
from engines.train.stream import (
    StepClosed,
    StreamProducer,
    append_chunk,
    claimed,
    close_stream,
    open_stream,
    read_batch,
    read_state,
    step_store,
    try_claim,
    write_chunk,
)
from engines.train.worker import GradWorker
from tests.train_fixtures import (
    chunks_by_execution,
    load_float32,
    packed_batch,
    perturb_behaviour,
    reference_step,
    tiny_model,
)

pytestmark = pytest.mark.slow

LULL_S = 1.5
BEFORE_LULL = 4  # chunks that arrive before the lull


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("streaming")
    model_dir = str(root / "policy")
    tiny_model(5).save_pretrained(model_dir, safe_serialization=True)
    batch = packed_batch(str(root / "data"), seed=11, n_executions=10, budget=16)
    perturb_behaviour(batch, 11)
    chunks = []
    for k, (sequences, n_executions) in enumerate(chunks_by_execution(batch, 1)):
        uri = write_chunk(sequences, str(root / "chunks" / f"chunk{k}.parquet"))
        chunks.append({"uri": uri, "count": len(sequences), "n_executions": n_executions, "key": f"c{k}"})
    assert len(chunks) > BEFORE_LULL + 2 and sum(c["n_executions"] for c in chunks) == len(batch.advantages)
    weights_dir = str(root / "fast")
    os.makedirs(weights_dir)
    uri = write_chunk(batch.sequences, str(root / "batch.parquet"))
    return {"root": root, "chunks": chunks, **reference_step(model_dir, batch, uri, weights_dir)}


def _update_diff(weights, reference, initial) -> float:
    """|| update - reference update || / || reference update || over all parameters."""
    num = den = 0.0
    for name, ref in reference.items():
        update, ref_update = weights[name] - initial[name], ref - initial[name]
        num += float((update - ref_update).double().pow(2).sum())
        den += float(ref_update.double().pow(2).sum())
    return (num / den) ** 0.5


def _schedule(chunks: list[dict]) -> list[tuple[float, dict]]:
    """(delay before the append, chunk): a few chunks, a lull, the rest."""
    return [(LULL_S if k == BEFORE_LULL else 0.1, c) for k, c in enumerate(chunks)]


class _Producer(threading.Thread):
    """The campaign's side: appends chunks on a schedule through its own store client, then closes
    (``close`` False: never, the step's deadline closes it)."""

    def __init__(self, address, schedule, close: bool = True, on_lull=None):
        super().__init__(daemon=True)
        self.address, self.schedule, self.close_it, self.on_lull = address, schedule, close, on_lull
        self.error: BaseException | None = None
        self.refused: list[str] = []

    def run(self) -> None:
        try:
            producer = StreamProducer(*self.address)
            for k, (delay, chunk) in enumerate(self.schedule):
                if k == BEFORE_LULL and self.on_lull:
                    self.on_lull()
                time.sleep(delay)
                try:
                    producer.append(chunk["uri"], chunk["count"], chunk["n_executions"], key=chunk["key"])
                except StepClosed:
                    self.refused.append(chunk["key"])
            if self.close_it:
                producer.close()
        except BaseException as error:  # surfaced by the test
            self.error = error


def _stream(setup, satellites: list[dict], *, pace_s: float = 0.0, on_lull=None, config=None):
    """One streaming step of a fresh core with ``satellites`` (satellite_main kwargs) as processes."""
    core = CoreTrainer(load_float32(setup["model_dir"]), setup["config"])
    coordinator = ElasticCoordinator(core, config=config)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ready = [context.Event() for _ in satellites]
    processes = [
        context.Process(
            target=satellite_main,
            args=(coordinator.host, coordinator.port, 0, setup["model_dir"]),
            kwargs={"ready": event, "results": results, **spec},
            daemon=True,
        )
        for spec, event in zip(satellites, ready, strict=True)
    ]
    for process in processes:
        process.start()
    for event in ready:  # every satellite is up before the step opens (start-up is seconds here)
        assert event.wait(120)
    step = coordinator.open_step(0, weights_dir=setup["weights_dir"])
    producer = _Producer(step.address, _schedule(setup["chunks"]), on_lull=on_lull)
    producer.start()
    report = step.train(pace_s=pace_s)
    producer.join(10)
    assert producer.error is None, producer.error
    for process in processes:
        process.join(timeout=60)
    outcomes = []
    while not results.empty():
        outcomes.append(results.get())
    coordinator.close()
    return core, report, [p.exitcode for p in processes], outcomes


@pytest.fixture(scope="module")
def alone(setup):
    """The streaming step of the core alone: the bitwise reference of the satellite tests."""
    core, report, _, _ = _stream(setup, [])
    return {"weights": core.weights(), "grad": core.last_grad.clone(), "report": report}


def _grad_diff(grad: torch.Tensor, reference: torch.Tensor) -> float:
    return float((grad - reference).norm() / reference.norm())


def _same_bits(weights, alone) -> bool:
    return all(torch.equal(weights[name], ref) for name, ref in alone["weights"].items())


def _every_micro_batch_once(report) -> None:
    assert sorted(i for ids in report.by_participant.values() for i in ids) == list(
        range(report.micro_batches)
    ), report.by_participant


def test_a_stream_of_the_core_alone_equals_the_whole_batch_step(setup, alone):
    report, batch = alone["report"], setup["batch"]
    assert report.closed_by == "producer" and report.trained and report.version == 1
    assert report.micro_batches == len(batch.sequences) and report.n_executions == len(batch.advantages)
    assert report.stats.micro_batches == list(range(report.micro_batches))
    _every_micro_batch_once(report)
    # micro-batches by arrival: the lull shows, and the core waited through it
    first_after_lull = sum(c["count"] for c in setup["chunks"][:BEFORE_LULL])
    arrivals = report.arrivals_s
    assert arrivals == sorted(arrivals) and len(arrivals) == report.micro_batches
    assert arrivals[first_after_lull] - arrivals[first_after_lull - 1] >= LULL_S * 0.9
    assert report.wait_s[0] >= LULL_S * 0.8
    metrics = report.metrics()
    assert metrics["tokens_trained"] == batch.n_target_tokens
    assert metrics["core_wait_s"] == report.wait_s[0] and metrics["last_arrival_s"] == arrivals[-1]
    grad_diff = _grad_diff(alone["grad"], setup["reference_grad"])
    diff = _update_diff(alone["weights"], setup["reference"], setup["initial"])
    print(f"streaming vs whole-batch: gradient rel diff {grad_diff:.3e}, update rel diff {diff:.3e}")
    assert grad_diff <= 1e-6 and diff <= 1e-4
    ref = setup["reference_report"]
    assert report.stats.loss == pytest.approx(ref.stats.loss, rel=1e-6)
    assert report.grad_norm == pytest.approx(ref.grad_norm, rel=1e-6)


def test_satellites_joining_mid_stream_give_the_same_bits(setup, alone):
    before_lull = sum(c["count"] for c in setup["chunks"][:BEFORE_LULL])
    satellites = [{"pace_s": 0.2}, {"pace_s": 0.2, "join_after_claims": before_lull}]  # 2nd joins in the lull
    core, report, exitcodes, outcomes = _stream(setup, satellites, pace_s=0.3)
    assert exitcodes == [0, 0]
    _every_micro_batch_once(report)
    assert len(report.members) == 3 and all(report.by_participant[sid] for sid in report.members), report
    late = next(o for o in outcomes if o["micro_batches"] and min(o["micro_batches"]) >= before_lull)
    assert late["member"], outcomes  # the one that joined in the lull trained only what came after it
    assert _same_bits(core.weights(), alone)


def test_a_satellite_dying_mid_stream_loses_nothing(setup, alone):
    """It dies after its first micro-batch, before the lull: the core finds out during the lull and
    recomputes that micro-batch then, not at the end."""
    config = ElasticConfig(dead_after_s=1.0)
    core, report, exitcodes, _ = _stream(setup, [{"die_after": 1}], pace_s=0.3, config=config)
    assert exitcodes == [-9]  # SIGKILLed
    assert report.dead == [1] and report.members == [0], report
    assert report.recomputed and report.recomputed_early == sorted(report.recomputed), report
    _every_micro_batch_once(report)
    assert _same_bits(core.weights(), alone)


def test_a_stalled_satellite_is_evicted_and_its_late_word_ignored(setup, alone):
    """A satellite alive but silent (its heartbeat every 30 s, the core's patience 0.5 s) is evicted
    mid-stream: it stops when it sees so, and only the core's recomputation of its work counts."""
    core = CoreTrainer(load_float32(setup["model_dir"]), setup["config"])
    coordinator = ElasticCoordinator(core, config=ElasticConfig(dead_after_s=0.5))
    step = coordinator.open_step(0, weights_dir=setup["weights_dir"])
    worker = GradWorker(load_float32(setup["model_dir"]), LossConfig())
    outcome = {}

    def satellite() -> None:
        config = ElasticConfig(heartbeat_s=30.0)
        outcome.update(
            run_satellite(
                coordinator.host, coordinator.port, 0, worker, read_batch, config=config, pace_s=0.2
            )
        )

    thread = threading.Thread(target=satellite, daemon=True)
    thread.start()
    producer = _Producer(step.address, _schedule(setup["chunks"]))
    producer.start()
    report = step.train(pace_s=0.3)
    producer.join(10)
    thread.join(30)
    coordinator.close()
    assert producer.error is None
    assert outcome.get("evicted") and outcome["micro_batches"], outcome
    assert report.dead == [1] and report.members == [0] and 1 not in report.by_participant, report
    assert set(outcome["micro_batches"]) <= set(report.recomputed)
    _every_micro_batch_once(report)
    assert _same_bits(core.weights(), alone)


def test_satellites_leaving_mid_stream_hand_their_work_over(setup, alone):
    """One leaves after its first micro-batch, one is asked to leave during the lull (idle): both
    return before the step closes, and what they computed counts."""
    context = multiprocessing.get_context("spawn")
    leave = context.Event()
    satellites = [{"pace_s": 0.2, "leave_after": 1}, {"pace_s": 0.2, "leave": leave}]
    core, report, exitcodes, outcomes = _stream(setup, satellites, pace_s=0.3, on_lull=leave.set)
    assert exitcodes == [0, 0]
    assert len(outcomes) == 2 and all(o["left"] for o in outcomes), outcomes
    assert report.left == sorted(o["sid"] for o in outcomes) and report.members == [0], report
    closed_at = report.timings["closed_after"]
    for outcome in outcomes:
        assert outcome["left_after_s"] < closed_at  # back to rollout while the step still streams
        assert report.by_participant[outcome["sid"]] == outcome["micro_batches"]
    assert any(o["micro_batches"] for o in outcomes)  # at least one handed a real sum over
    handoffs = [name for name in os.listdir(setup["weights_dir"]) if name.endswith(".grad.safetensors")]
    assert not handoffs  # the core consumed them
    _every_micro_batch_once(report)
    assert report.metrics()["satellites_left"] == 2
    assert _same_bits(core.weights(), alone)


def test_the_deadline_closes_the_step_with_what_has_arrived(setup):
    chunks = setup["chunks"]
    core = CoreTrainer(load_float32(setup["model_dir"]), setup["config"])
    coordinator = ElasticCoordinator(core)
    step = coordinator.open_step(0, weights_dir=setup["weights_dir"], deadline_s=1.0)
    # three executions arrive in time (3: no power of two, whose division would be exact), one late
    schedule = [(0.05, chunks[0]), (0.05, chunks[1]), (0.05, chunks[2]), (2.0, chunks[3])]
    producer = _Producer(step.address, schedule, close=False)
    producer.start()
    report = step.train()
    producer.join(10)
    coordinator.close()
    assert producer.error is None and producer.refused == [chunks[3]["key"]]
    arrived = sum(c["count"] for c in chunks[:3])
    n_executions = sum(c["n_executions"] for c in chunks[:3])
    assert report.closed_by == "deadline" and report.micro_batches == arrived
    assert report.n_executions == n_executions and 1.0 <= report.timings["closed_after"] < 2.0
    # the same micro-batches and normalizer as a whole-batch step
    reference = CoreTrainer(load_float32(setup["model_dir"]), setup["config"])
    ref_coordinator = ElasticCoordinator(reference)
    sequences = setup["batch"].sequences[:arrived]
    uri = write_chunk(sequences, str(setup["root"] / "arrived.parquet"))
    ref_coordinator.run_step(1, sequences, n_executions, batch_uri=uri, weights_dir=setup["weights_dir"])
    ref_coordinator.close()
    grad_diff = _grad_diff(core.last_grad, reference.last_grad)
    diff = _update_diff(core.weights(), reference.weights(), setup["initial"])
    print(f"deadline step vs whole-batch: gradient rel diff {grad_diff:.3e}, update rel diff {diff:.3e}")
    assert grad_diff <= 1e-6 and diff <= 1e-4


def test_a_step_closed_empty_makes_a_version_without_an_update(setup):
    """As engines/train/run.py does for an empty batch; a satellite waiting in it goes home."""
    core = CoreTrainer(load_float32(setup["model_dir"]), setup["config"])
    coordinator = ElasticCoordinator(core)
    step = coordinator.open_step(0, weights_dir=setup["weights_dir"])
    worker = GradWorker(load_float32(setup["model_dir"]), LossConfig())
    outcome = {}

    def satellite() -> None:
        outcome.update(run_satellite(coordinator.host, coordinator.port, 0, worker, read_batch))

    thread = threading.Thread(target=satellite, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not step.store.check(["active/1"]):
        assert time.time() < deadline
        time.sleep(0.01)
    step.close()
    report = step.train()
    thread.join(30)
    coordinator.close()
    assert not report.trained and report.micro_batches == 0 and report.grad_norm == 0.0
    assert report.version == 1 and core.version == 1 and core.step == 1
    assert all(torch.equal(core.weights()[k], v) for k, v in setup["initial"].items())
    assert outcome["sid"] == 1 and outcome["micro_batches"] == [], outcome
    assert not outcome["left"] and not outcome["member"]


# -- the queue itself, on a bare store ----------------------------------------------------------
def _bare_store():
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    return server, step_store(server, 0)


def test_appends_are_idempotent_and_a_closed_step_refuses_them():
    _server, store = _bare_store()
    open_stream(store)
    first = append_chunk(store, "mem://a", 2, 1, key="g1")
    assert append_chunk(store, "mem://a", 2, 1, key="g1") == first  # a retried append
    second = append_chunk(store, "mem://b", 3, 2, key="g2")
    assert (first.first, second.first, read_state(store).total) == (0, 2, 5)
    assert read_state(store).chunk_of(4) == second and read_state(store).chunk_of(1) == first
    with pytest.raises(ValueError, match="executions"):
        append_chunk(store, "mem://c", 1, 0)
    closed = close_stream(store)
    assert closed.closure.n_executions == 3 and closed.closure.by == "producer"
    assert close_stream(store, 7).closure == closed.closure  # the first close stands
    with pytest.raises(StepClosed):
        append_chunk(store, "mem://c", 1, 1, key="g3")
    assert append_chunk(store, "mem://a", 2, 1, key="g1") == first  # still idempotent after close


def test_concurrent_claims_take_each_arrived_micro_batch_once():
    server, store = _bare_store()
    open_stream(store)
    taken: dict[int, list[int]] = {}

    def claimer(who: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
        mine = step_store(client, 0)
        taken[who] = []
        while True:
            state = read_state(mine)
            index = try_claim(mine, who, state.total)
            if index is None:
                if state.closure is not None:
                    return
                time.sleep(0.001)
                continue
            assert index < state.total  # never a claim on what has not arrived
            taken[who].append(index)

    threads = [threading.Thread(target=claimer, args=(who,), daemon=True) for who in range(4)]
    for thread in threads:
        thread.start()
    for k in range(20):
        append_chunk(store, f"mem://{k}", 5, 1)
        time.sleep(0.002)
    close_stream(store)
    for thread in threads:
        thread.join(30)
    assert sorted(i for ids in taken.values() for i in ids) == list(range(100))
    assert claimed(store) == 100


def test_an_idle_participant_looks_less_often_until_work_arrives():
    from engines.train.elastic_protocol import Idle

    idle = Idle(ElasticConfig(poll_s=0.001, idle_max_s=0.004))
    waits = []
    for _ in range(4):
        waits.append(idle.next)
        idle.wait()
    assert waits == [0.001, 0.002, 0.004, 0.004]  # doubling, capped
    idle.busy()
    assert idle.next == 0.001  # work arrived: look again soon
    assert Idle(ElasticConfig(poll_s=0.02, idle_max_s=0.01)).most == 0.02  # never below the first wait
