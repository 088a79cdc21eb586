"""The core as a DeepSpeed world of several ranks (TrainStepRequest.core): rank 0 is the trainer
process (python -m engines.train.run), rank 1 a peer (python -m engines.train.peer) that restores
from the same checkpoint, makes the same updates with the gradient sum rank 0 sends, and writes its
ZeRO optimizer share into the step's checkpoint. Real processes, real DeepSpeed over gloo on loopback
(tests/test_hosts.py runs a peer on another host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import fsspec
import pytest
import torch

from engines.model.weights import load_model
from engines.net import free_port
from engines.train.config import CoreWorld, TrainerConfig
from engines.train.run import TrainStepRequest
from tests.train_fixtures import policy_and_batch

pytestmark = pytest.mark.slow

TRAINER = TrainerConfig(lr=1e-3, zero_stage=1, eps=1e-6, mini_batches=2)  # 2 updates a step


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("core-world")
    model_dir, batch, batch_uri = policy_and_batch(root, 7, 13, n_executions=8, budget=16)
    return {"root": root, "model_dir": model_dir, "batch": batch, "batch_uri": batch_uri}


def _request(
    setup, name: str, step: int, ranks: int, trainer: TrainerConfig = TRAINER, **core
) -> TrainStepRequest:
    root = setup["root"] / name
    os.makedirs(root / "fast", exist_ok=True)
    world = None if ranks == 1 else CoreWorld(address="127.0.0.1", port=free_port(), size=ranks, **core)
    return TrainStepRequest(
        step=step,
        init_model=setup["model_dir"],
        resume_from=None if step == 0 else str(root / f"ck{step - 1}"),
        batch_uri=setup["batch_uri"],
        n_executions=len(setup["batch"].advantages),
        checkpoint_url=str(root / f"ck{step}"),
        policy_root=str(root / "store"),
        fast_dir=str(root / "fast"),
        trainer=trainer,
        seed=3,
        core=world,
    )


def _start(module: str, request: TrainStepRequest, *args: str) -> subprocess.Popen:
    with tempfile.TemporaryFile("w+") as stdin:  # the child keeps its own descriptor
        stdin.write(request.model_dump_json())
        stdin.seek(0)
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def _last_line(process: subprocess.Popen, timeout_s: float = 300) -> dict:
    out, err = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _step(request: TrainStepRequest) -> tuple[dict, list[dict]]:
    """The step on every rank of its core: rank 0's report and the peers' reports."""
    ranks = 1 if request.core is None else request.core.size
    trainer = _start("engines.train.run", request)
    peers = [_start("engines.train.peer", request, "--rank", str(r)) for r in range(1, ranks)]
    return _last_line(trainer), [_last_line(p) for p in peers]


def _weights(checkpoint_url: str) -> dict[str, torch.Tensor]:
    return load_model(checkpoint_url + "/hf", dtype="float32").state_dict()


def test_a_core_of_two_ranks_makes_the_one_rank_update_and_checkpoints_its_shares(setup):
    one = [_step(_request(setup, "one", step, 1))[0] for step in (0, 1)]
    two = []
    for step in (0, 1):  # step 1 resumes both ranks from step 0's checkpoint, each with its share
        report, peers = _step(_request(setup, "two", step, 2))
        two.append(report)
        assert peers[0]["rank"] == 1 and peers[0]["updates"] == 2  # both of the step's updates
        # both ranks computed: rank 1 took micro-batches of each update as a satellite holding the weights
        own, total = report["metrics"]["core_micro_batches"], report["metrics"]["micro_batches"]
        print(f"step {step}: rank 0 computed {own:.0f} micro-batches, rank 1 {peers[0]['micro_batches']}")
        assert own >= 1 and peers[0]["micro_batches"] >= 1 and own + peers[0]["micro_batches"] == total
        assert (peers[0]["step"], peers[0]["version"]) == (step + 1, step + 1)
        # ZeRO 1 over 2 ranks: each holds about half the master copy and AdamW's moments (partitions
        # are padded to alignment, so not exactly)
        alone = one[step]["optimizer_state_bytes"]
        for held in (report["optimizer_state_bytes"], peers[0]["optimizer_state_bytes"]):
            assert 0.4 * alone <= held <= 0.6 * alone
    assert [r["version"] for r in two] == [1, 2] and two[1]["metrics"]["updates"] == 2.0
    start = load_model(setup["model_dir"], dtype="float32").state_dict()
    a, b = _weights(one[1]["checkpoint_url"]), _weights(two[1]["checkpoint_url"])
    update_size = max(float((a[n] - start[n]).abs().max()) for n in a)
    update_diff = max(float((b[n] - a[n]).abs().max()) for n in a)
    print(
        f"two ranks' weights after 2 steps differ from one rank's by {update_diff / update_size:.2e} of the update"
    )
    assert update_diff <= 1e-6 * max(update_size, 1.0)
    for name, value in a.items():
        assert not torch.equal(value, start[name]) or "norm" in name  # it trained
        torch.testing.assert_close(b[name], value, rtol=1e-5, atol=1e-6)
    # the checkpoint holds each rank's ZeRO share, written by that rank
    fs, root = fsspec.core.url_to_fs(two[1]["checkpoint_url"])
    shares = sorted(p.rsplit("/", 1)[-1] for p in fs.find(root) if "optim_states" in p)
    assert shares == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert json.loads(fs.cat(f"{root}/trainer_state.json"))["ranks"] == 2


def test_a_rank_that_never_comes_fails_the_step_in_its_timeout_and_a_mismatched_checkpoint_is_refused(setup):
    request = _request(setup, "alone", 0, 2, timeout_s=5)
    started = time.monotonic()
    trainer = _start("engines.train.run", request)  # no peer
    trainer.communicate(timeout=120)
    assert trainer.returncode != 0 and time.monotonic() - started < 90
    # a ZeRO checkpoint of two ranks cannot resume a core of one
    _step(_request(setup, "resize", 0, 2))
    resumed = _request(setup, "resize", 1, 1)
    trainer = _start("engines.train.run", resumed)
    _, err = trainer.communicate(timeout=120)
    assert trainer.returncode != 0
    assert "holds ZeRO stage 1 optimizer shares of 2 core ranks; this core has 1" in err
