"""Elastic data parallel on real processes: satellites join a running step over a TCPStore and gloo.

The update must equal single-process training on the same batch, whatever the number of
satellites and whenever they join, and every micro-batch must be used exactly once, also when a
satellite is killed mid-step."""

from __future__ import annotations

import os

import pytest

from engines.train.core import CoreTrainer
from engines.train.elastic import ElasticCoordinator
from engines.train.satellite import start_satellites
from tests.train_fixtures import load_float32, policy_and_batch, reference_step, update_rel_diff

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("elastic")
    model_dir, batch, batch_uri = policy_and_batch(root, 5, 11, n_executions=10, budget=16)
    assert len(batch.sequences) >= 8
    weights_dir = str(root / "fast")
    os.makedirs(weights_dir)
    return {"batch_uri": batch_uri, **reference_step(model_dir, batch, batch_uri, weights_dir)}


def _run(setup, satellites: list[dict], pace_s: float):
    core = CoreTrainer(load_float32(setup["model_dir"]), setup["config"])
    coordinator = ElasticCoordinator(core)
    # the step starts once every satellite is up (process start-up is seconds here)
    processes = start_satellites(
        coordinator.host, coordinator.port, setup["model_dir"], satellites, pace_s=pace_s
    )
    batch = setup["batch"]
    report = coordinator.run_step(
        0,
        batch.sequences,
        len(batch.advantages),
        batch_uri=setup["batch_uri"],
        weights_dir=setup["weights_dir"],
        pace_s=pace_s,
    )
    for process in processes:
        process.join(timeout=60)
    return core, report, [p.exitcode for p in processes]


def test_reference_step_uses_every_micro_batch_once(setup):
    report = setup["reference_report"]
    assert report.members == [0]
    assert report.stats.micro_batches == list(range(report.micro_batches))
    assert report.version == 1 and report.grad_norm > 0
    metrics = report.metrics()
    assert metrics["tokens_trained"] == setup["batch"].n_target_tokens
    assert 0 < metrics["clip_fraction"] < 1


@pytest.mark.parametrize(
    "satellites",
    [
        [{}],  # one satellite from the start
        [{}, {"join_after_claims": "half"}],  # a second one joins after half the micro-batches
    ],
    ids=["one", "two-one-late"],
)
def test_satellites_joining_give_the_same_update(setup, satellites):
    n = len(setup["batch"].sequences)
    specs = [{k: (n // 2 if v == "half" else v) for k, v in s.items()} for s in satellites]
    core, report, exitcodes = _run(setup, specs, pace_s=0.3)
    assert exitcodes == [0] * len(specs)
    assert sorted(i for ids in report.by_participant.values() for i in ids) == list(range(n))
    assert len(report.members) == 1 + len(specs), report
    assert all(report.by_participant[sid] for sid in report.members[1:]), report.by_participant
    diff = update_rel_diff(core.weights(), setup)
    print(f"update rel diff {diff:.3e}")
    assert diff <= 1e-4  # Adam's first step amplifies rounding: tests/test_streaming.py says why
    assert report.metrics()["tokens_trained"] == setup["batch"].n_target_tokens


def test_a_satellite_killed_mid_step_loses_nothing(setup):
    core, report, exitcodes = _run(setup, [{"die_after": 1}, {}], pace_s=0.3)
    assert -9 in exitcodes  # the SIGKILLed one
    assert len(report.dead) == 1 and report.recomputed, report
    assert sorted(i for ids in report.by_participant.values() for i in ids) == list(
        range(report.micro_batches)
    )
    diff = update_rel_diff(core.weights(), setup)
    print(f"update rel diff {diff:.3e}")
    assert diff <= 1e-4  # Adam's first step amplifies rounding: tests/test_streaming.py says why
