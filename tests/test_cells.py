"""A cell's round trip on real processes: a rollout engine behind the gateway and a trainer replica.

rollout -> train while an execution's session lives on the cell's engine: the session moves to the
engine that stays (with its KV cache) and its next call succeeds there; the replica joins a streaming
step in progress. train -> rollout before the step closes: the replica leaves (its work handed to the
core), the engine wakes and takes new sessions. The step's update still equals the same batch trained
by one process, and every switch is timed per phase."""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest
import torch

from engines.admin import AdminClient
from environments.gateway_admin import GatewayAdmin
from scheduler.cells import CellPool, CellSpec, Left, Replica
from stack.stack import local_stack
from tests.campaign_fixtures import tiny_policy
from tests.train_fixtures import CoreStreaming, streamed_case, update_rel_diff
from trajectory_store.storage import StoreConfig

pytestmark = pytest.mark.slow


def _register(stack, execution_id: str) -> dict:
    """The execution registered as a dispatcher registers one (environments/gateway_admin.py)."""

    async def register() -> dict:
        async with httpx.AsyncClient() as client:
            return await GatewayAdmin(stack.gateway_url, stack.admin_token, client).register(execution_id)

    return asyncio.run(register())


def _chat(registration: dict, text: str) -> dict:
    response = httpx.post(
        f"{registration['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {registration['api_key']}"},
        json={"model": "gyre-policy", "messages": [{"role": "user", "content": text}], "max_tokens": 4},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_a_cell_moves_to_training_and_back_without_interrupting_an_execution(tmp_path):
    torch.set_num_threads(1)
    policy = tiny_policy(tmp_path / "policy")
    chunks, setup = streamed_case(tmp_path, 11)  # and the same batch, one process, not streamed
    trainer_model = setup["model_dir"]

    with local_stack(policy, StoreConfig(data_root=str(tmp_path / "data")), engines=2) as stack:
        admin = AdminClient(stack.gateway_url, stack.admin_token, stack.engine_admin_token)
        register = _register(stack, "e1")
        first = _chat(register, "hello")["gyre"]["engine_id"]
        engines = {e.engine_id: e.url for e in admin.gateway_stats().engines}
        other = next(e for e in engines if e != first)
        specs = [
            CellSpec("cell-0", engines[other], other, core=True),
            CellSpec("cell-1", engines[first], first),
        ]
        pool = CellPool.behind_gateway(admin, specs, trainer_model)
        try:
            streaming = CoreStreaming(setup)
            streaming.append(chunks[:2])

            to_train = pool.to_train("cell-1", streaming.step.address)
            assert set(to_train.phases) == {"drain", "sleep", "join"}
            assert to_train.detail["migrated_sessions"] == 1 and not to_train.detail["drain_failed"]
            assert not to_train.detail["late"] and to_train.detail["weight_pull_s"] is not None
            # the execution goes on, on the engine that stays
            assert _chat(register, "and then?")["gyre"]["engine_id"] == other
            assert admin.engine_stats(engines[first]).asleep

            streaming.append(chunks[2:])
            to_rollout = pool.to_rollout("cell-1", 1, os.path.join(policy, "model.safetensors"))
            assert set(to_rollout.phases) == {"leave", "wake", "register"}
            stats = admin.engine_stats(engines[first])
            assert not stats.asleep and stats.policy_version == 1
            # the woken engine takes new sessions again (the other one holds e1)
            second = _register(stack, "e2")
            assert _chat(second, "hi")["gyre"]["engine_id"] == first

            report = streaming.finish()
            assert report.left, "the replica left the step before it closed"
            used = sorted(i for ids in report.by_participant.values() for i in ids)
            assert used == list(range(report.micro_batches))
            # streamed with a satellite that came and went == the batch trained by one process
            # (1e-5: the streaming normalizer's rounding, engines/train/elastic.py)
            assert update_rel_diff(streaming.core.weights(), setup) < 1e-5
            assert [s.to for s in pool.switches] == ["train", "rollout"]
            assert [c.role for c in pool.states()] == ["rollout", "rollout"]
        finally:
            pool.close()


def test_a_step_result_collected_by_poll_still_ends_a_replicas_leave(tmp_path):
    """The controller collects a step's result (poll) while a switch to rollout waits for it
    (leave_step): both read one event, and before 2026-12-06 the one that lost waited 60 s for
    another and failed the switch. Now one thread reads the events: the switch returns the step's
    result, and poll hands it out once at most."""
    replica = Replica(tiny_policy(tmp_path / "policy"), threads=1)
    try:
        replica.wait_ready()
        assert replica.devices is not None
        with replica._cond:  # as if in a step: join() sets it so
            replica.busy = True
        seen: list[dict] = []
        stop = threading.Event()

        def collect() -> None:  # the controller's _drain_result, polling hard
            while not stop.is_set():
                if (result := replica.poll()) is not None:
                    seen.append(result)

        poller = threading.Thread(target=collect)
        poller.start()
        left: list[dict] = []
        leaving = threading.Thread(target=lambda: left.append(replica.leave_step(timeout_s=20)))
        leaving.start()
        assert replica.leave.wait(timeout=10)  # leave_step is waiting for the step's end
        replica.events.put(Left({"micro_batches": [], "left": False}))  # the step closed on its own
        leaving.join(timeout=30)
        stop.set()
        poller.join()
        assert not leaving.is_alive() and left, "leave_step did not return once the step had ended"
        assert not replica.busy and replica.last_result == {"micro_batches": [], "left": False}
        assert left[0] == {"micro_batches": [], "left": False}, left  # what the switch times its hand-off by
        assert seen in ([], [left[0]]), seen  # poll hands a result out once at most
    finally:
        replica.stop()
