"""Several optimizer updates per step (TrainerConfig.mini_batches and epochs): the step's batch is
split into mini-batches, every sequence is trained once per epoch, the last update makes the one
new version, and a retried step makes the same updates."""

from __future__ import annotations

import os
import random

import pytest
import torch

from engines.model.weights import load_model
from engines.train.config import TrainerConfig
from engines.train.core import CoreTrainer
from engines.train.run import TrainStepRequest, mini_batches, step_updates, train_step
from flows.config import CampaignConfig
from tasks.train import CoreService
from tests.train_fixtures import policy_and_batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("updates")
    model_dir, batch, batch_uri = policy_and_batch(root, 7, 13, n_executions=8, budget=16)
    assert len(batch.sequences) >= 6
    return {"root": root, "model_dir": model_dir, "batch": batch, "batch_uri": batch_uri}


def _request(setup, name: str, trainer: TrainerConfig) -> TrainStepRequest:
    root = setup["root"]
    os.makedirs(root / name / "fast", exist_ok=True)
    return TrainStepRequest(
        step=0,
        init_model=setup["model_dir"],
        batch_uri=setup["batch_uri"],
        n_executions=len(setup["batch"].advantages),
        checkpoint_url=str(root / name / "ck"),
        policy_root=str(root / name / "store"),
        fast_dir=str(root / name / "fast"),
        trainer=trainer,
        seed=3,
    )


def _weights(report) -> dict[str, torch.Tensor]:
    return {
        k: v.float()
        for k, v in load_model(report.checkpoint_url + "/hf", dtype="float32").state_dict().items()
    }


def test_mini_batches_use_every_sequence_once_and_balance_tokens(setup):
    sequences = setup["batch"].sequences
    parts = mini_batches(sequences, 3, random.Random(0))
    assert len(parts) == 3 and all(parts)
    assert sorted(id(s) for part in parts for s in part) == sorted(id(s) for s in sequences)
    sizes = [sum(len(s) for s in part) for part in parts]
    assert max(sizes) - min(sizes) <= max(len(s) for s in sequences)
    assert len(mini_batches(sequences[:2], 5, random.Random(0))) == 2  # never an empty mini-batch


def test_several_updates_make_one_version_and_repeat_exactly(setup):
    one = train_step(_request(setup, "one", TrainerConfig(lr=1e-3, zero_stage=0, eps=1e-6)))
    config = TrainerConfig(lr=1e-3, zero_stage=0, eps=1e-6, mini_batches=3, epochs=2)
    many = train_step(_request(setup, "many", config))
    assert (one.version, many.version) == (1, 1)
    assert (one.metrics["updates"], many.metrics["updates"]) == (1.0, 6.0)
    assert many.metrics["micro_batches"] == 2 * len(setup["batch"].sequences)
    assert many.metrics["tokens_trained"] == one.metrics["tokens_trained"]
    assert many.policy_uri.endswith("policy/v1/model.safetensors")

    # the same six updates by hand: the mini-batches of each epoch, one AdamW update each
    core = CoreTrainer(load_model(setup["model_dir"], dtype="float32"), config)
    rng = random.Random("3/0")
    n = len(setup["batch"].advantages)
    for _ in range(2):
        for part in mini_batches(setup["batch"].sequences, 3, rng):
            core.sync_worker()
            core.worker.reset()
            for index, sequence in enumerate(part):
                core.worker.accumulate(sequence, n, index, 0)
            core.apply(core.worker.grad.clone(), new_version=False)
    by_hand = core.weights()
    trained, single = _weights(many), _weights(one)
    moved_more = 0
    for name, value in by_hand.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6)
        start = load_model(setup["model_dir"], dtype="float32").state_dict()[name]
        moved_more += float((trained[name] - start).norm()) > float((single[name] - start).norm())
    assert moved_more > len(by_hand) // 2  # six updates move most tensors further than one
    assert (core.step, core.version) == (0, 0)  # updates inside a step make no version

    again = train_step(_request(setup, "again", config))  # a retried step: the same updates
    for name, value in _weights(again).items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)


def test_streaming_steps_refuse_several_updates():
    with pytest.raises(ValueError, match=r"mini_batches = 2 and epochs = 1.*one update each"):
        CampaignConfig.model_validate({"trainer": {"mini_batches": 2}, "scheduler": {"policy": "elastic"}})
    assert CampaignConfig.model_validate({"trainer": {"mini_batches": 2}}).trainer.updates_per_step == 2


def test_a_batch_without_sequences_makes_a_version_without_an_update(setup):
    request = _request(setup, "empty", TrainerConfig(zero_stage=0, mini_batches=3, epochs=2))
    core = CoreTrainer(load_model(setup["model_dir"], dtype="float32"), request.trainer)
    before = core.weights()
    metrics = step_updates(core, request, [])
    assert (core.step, core.version, metrics["updates"], metrics["micro_batches"]) == (1, 1, 1.0, 0.0)
    for name, value in core.weights().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_a_serving_core_prepared_before_its_step_makes_the_same_update(setup):
    """A scheduler warms its core before the first dispatch (Controller.run): the prepared core
    restores once, answers again without restoring, and its step makes the update a one-shot
    process makes from the same request, bit for bit."""
    trainer = TrainerConfig(zero_stage=0)
    once = train_step(_request(setup, "one-shot", trainer))
    request = _request(setup, "prepared", trainer)
    core = CoreService(threads=1)
    try:
        first = core.prepare(request)
        assert (first["step"], first["restored"]) == (0, True) and first["seconds"] > 0
        assert core.prepare(request)["restored"] is False  # at that step already: kept, not restored
        report = core.step(request).wait()
        nxt = request.model_copy(update={"step": 1, "resume_from": request.checkpoint_url})
        assert core.prepare(nxt)["restored"] is False  # the step it made left it at step 1
    finally:
        core.close()
    assert (report.step, report.version, report.trained) == (0, 1, True)
    assert report.metrics["loss"] == once.metrics["loss"]
    prepared, reference = _weights(report), _weights(once)
    for name, value in reference.items():
        torch.testing.assert_close(prepared[name], value, rtol=0, atol=0)
