"""A cell's trainer replica served over HTTP (scheduler/remote.py), as a cell on another host serves it:
the scheduler's `RemoteReplica` joins a streaming step through it and leaves before the step closes;
the replica's gradients are taken with the core's loss (sent with the join), so the update equals the
batch trained by one process with that loss. A request without the token is refused."""

from __future__ import annotations

import httpx
import pytest
import torch

from engines.train.config import LossConfig
from scheduler.remote import ROUTE, RemoteReplica, ReplicaServer
from tests.train_fixtures import TRAINER, CoreStreaming, streamed_case, update_rel_diff

pytestmark = pytest.mark.slow


AUTH = {"Authorization": "Bearer secret-token"}


def test_a_remote_replica_joins_and_leaves_a_step_with_the_cores_loss(tmp_path):
    torch.set_num_threads(1)
    # not the default loss: a replica left with the default one would make another update
    config = TRAINER.model_copy(update={"loss": LossConfig(clip_low=0.05, clip_high=0.05)})
    chunks, setup = streamed_case(tmp_path, 13, config)
    model_dir = setup["model_dir"]

    with ReplicaServer(model_dir, "127.0.0.1", "secret-token") as server:
        refused = httpx.post(f"{server.url}{ROUTE}/poll", headers={"Authorization": "Bearer nope"})
        assert refused.status_code == 401
        malformed = httpx.post(  # a join without its step's port: refused with the field named
            f"{server.url}{ROUTE}/join", json={"host": "127.0.0.1", "step": 0}, headers=AUTH
        )
        assert malformed.status_code == 422 and "port" in malformed.text
        replica = RemoteReplica(server.url, "secret-token", loss=config.loss.model_dump())
        streaming = CoreStreaming(setup)
        streaming.append(chunks[:3])
        joined = replica.join(*streaming.step.address)
        assert not joined.get("late") and joined.get("pull_s") is not None and replica.busy
        streaming.append(chunks[3:])
        left = replica.leave_step()
        assert "handoff_s" in left and not replica.busy
        assert replica.poll() is None  # its result was collected by the leave
        report = streaming.finish()
        assert report.left, "the replica left the step before it closed"
        taken = {who: len(ids) for who, ids in report.by_participant.items()}
        assert len(taken) == 2 and all(taken.values()), taken  # the core and the replica both computed
        replica.stop()

    assert update_rel_diff(streaming.core.weights(), setup) < 1e-5
