"""The role_switch section: one cell going rollout -> train -> rollout through the product's own
switch sequence (scheduler/cells.py CellPool.to_train / to_rollout: drain -> sleep -> join, then
leave -> wake -> register, timed per phase by the pool), and how long each direction takes (goals:
3 s and 1.5 s).

The cell's two ends live in this process, on the one device: its engine is a RolloutEngine
(`DeviceEngine`: nothing to drain without a gateway; it sleeps, and wakes with the trainer's weights
from host memory), its trainer a GradWorker offloaded to host memory between train phases
(`DeviceTrainer`: join moves its weights to the device and runs the step's first micro-batch; leave
offloads it). Each end synchronizes the device before it returns, so the pool's clock is the device's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.engine_workload import device_clock
from bench.gpu.plan import GOALS_S
from bench.gpu.run import Run, free
from engines.admin import DrainReport
from engines.rollout.config import EngineConfig
from engines.rollout.engine import RolloutEngine
from engines.rollout.messages import GenerateRequest, SamplingParams
from engines.train.config import LossConfig
from engines.train.worker import GradWorker
from scheduler.cells import Cell, CellPool, CellSpec


class DeviceEngine:
    """A cell's engine in this process (scheduler.cells.EngineEnd)."""

    def __init__(
        self, engine: RolloutEngine, device: torch.device, weights: Callable[[], dict[str, torch.Tensor]]
    ):
        self.engine, self.device, self.weights = engine, device, weights

    def drain(self) -> DrainReport:  # no gateway: its sessions stay, their token histories kept
        return DrainReport(engine_id="device", state="draining")

    def sleep(self) -> None:
        self.engine.sleep()
        device_clock(self.device)

    def wake(self, version: int, weights_path: str) -> None:
        self.engine.wake(self.weights(), version)  # from host memory, not a file (a cheap switch)
        device_clock(self.device)

    def register(self) -> None:
        pass  # no gateway to route to it


class DeviceTrainer:
    """A cell's trainer replica in this process (scheduler.cells.TrainerEnd): a GradWorker whose weights
    stay in host memory between train phases; ``first_micro_batch()`` is what joining a step computes."""

    def __init__(self, worker: GradWorker, device: torch.device, first_micro_batch: Callable[[int], None]):
        self.worker, self.device, self.first_micro_batch = worker, device, first_micro_batch
        self.busy = False

    def join(self, host: str, port: int, step: int) -> dict[str, Any]:
        started = time.perf_counter()
        self.worker.model.to(self.device)
        pulled = device_clock(self.device)
        self.first_micro_batch(step)
        device_clock(self.device)
        self.busy = True
        return {"pull_s": round(pulled - started, 4)}

    def leave_step(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.worker.model.zero_grad(set_to_none=True)
        self.worker.model.to("cpu")
        free(self.device)
        self.busy = False
        return {"handoff_s": round(device_clock(self.device) - started, 4)}

    def poll(self) -> dict[str, Any] | None:
        return None

    def stop(self) -> None:
        pass


def section_role_switch(run: Run, figures: dict, deadline: float) -> None:
    plan, device = run.plan, run.device
    batch = run.batch()
    sequence = min(batch.sequences, key=len)
    n_executions = len(batch.advantages)
    rng = random.Random(5)
    engine_model = run.load(plan.switch_preset)
    context = [rng.randrange(engine_model.config.vocab_size) for _ in range(plan.switch_context)]
    engine = RolloutEngine(
        engine_model,
        EngineConfig(max_batch_size=4, max_model_len=plan.switch_context + 256, device=str(device)),
    )
    greedy = SamplingParams(temperature=0, max_tokens=16)
    first = engine.generate(
        [GenerateRequest(request_id="warm", session_id="s", prompt_ids=context, sampling=greedy)]
    )
    history = context + first[0].output_ids
    worker = GradWorker(run.load(plan.switch_preset, device="cpu"), LossConfig())  # the train cell, offloaded

    def first_micro_batch(step: int) -> None:
        worker.reset()
        worker.accumulate(sequence, n_executions, 0, step)

    spec = CellSpec("cell-1", engine_url="in-process", engine_id="engine-0")
    trainer = DeviceTrainer(worker, device, first_micro_batch)
    pool = CellPool([Cell(spec, DeviceEngine(engine, device, worker.model.state_dict), trainer)])
    figures.update(
        preset=plan.switch_preset,
        session_context_tokens=len(history),
        micro_batch_tokens=len(sequence),
        sequence="scheduler/cells.py CellPool: drain -> sleep -> join, then leave -> wake -> register",
        trainer_offload="weights moved to host memory (pageable) between train phases",
        goals_s=GOALS_S,
        cycles=[],
    )
    for cycle in range(2):  # the first is cold (first transfers, kernels); the second is reported
        if cycle and time.monotonic() > deadline:
            figures.setdefault("skipped", []).append("warm cycle: the section's time ran out")
            break
        to_train = pool.to_train(spec.cell_id, ("", 0, cycle))
        with torch.no_grad():  # the optimizer step (not timed): the trainer now holds NEW weights
            for param in worker.params:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-1e-3)
        to_rollout = pool.to_rollout(spec.cell_id, cycle + 1, "")
        history = history + [rng.randrange(engine_model.config.vocab_size) for _ in range(8)]
        started = time.perf_counter()
        out = engine.generate(
            [
                GenerateRequest(
                    request_id=f"c{cycle}",
                    session_id="s",
                    prompt_ids=history,
                    sampling=SamplingParams(temperature=0, max_tokens=1),
                )
            ]
        )[0]
        first_token_s = device_clock(device) - started
        probe = next(iter(worker.model.state_dict()))
        fresh = torch.equal(engine.runner.model.state_dict()[probe].cpu(), worker.model.state_dict()[probe])
        history = history + out.output_ids
        pull_s = to_train.detail["weight_pull_s"]
        figures["cycles"].append(
            {
                "rollout_to_train_s": round(to_train.seconds, 4),
                "drain_s": to_train.phases["drain"],
                "sleep_s": to_train.phases["sleep"],
                "trainer_to_device_s": pull_s,
                "first_micro_batch_s": round(to_train.phases["join"] - pull_s, 4),
                "train_to_rollout_s": round(to_rollout.seconds + first_token_s, 4),
                "trainer_offload_s": to_rollout.phases["leave"],
                "wake_s": to_rollout.phases["wake"],
                "register_s": to_rollout.phases["register"],
                "first_token_s": round(first_token_s, 4),
                "first_token_prefilled_tokens": out.prefilled_tokens,
                "engine_has_new_weights": fresh,
                "token_policy_version": out.policy_versions[0],
            }
        )
        run.write()
    last = figures["cycles"][-1]
    figures["rollout_to_train_s"] = last["rollout_to_train_s"]
    figures["train_to_rollout_s"] = last["train_to_rollout_s"]
    figures["rollout_to_train_goal_met"] = last["rollout_to_train_s"] <= GOALS_S["rollout_to_train"]
    figures["train_to_rollout_goal_met"] = last["train_to_rollout_s"] <= GOALS_S["train_to_rollout"]
    pool.close()
    del engine, engine_model
