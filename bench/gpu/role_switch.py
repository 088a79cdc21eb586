"""The role_switch section: one cell going rollout -> train -> rollout and how long each
direction takes (goals: 3 s and 1.5 s). ``switch_cycle`` holds the sequence itself."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from bench.engine_workload import device_clock
from bench.gpu.plan import GOALS_S
from bench.gpu.run import Run, free
from engines.rollout.config import EngineConfig
from engines.rollout.engine import RolloutEngine
from engines.rollout.messages import GenerateRequest, SamplingParams
from engines.train.config import LossConfig
from engines.train.worker import GradWorker


def switch_cycle(
    engine: RolloutEngine,
    worker: GradWorker,
    device: torch.device,
    train: Callable[[], int],
    mark: Callable[[str], None] = lambda phase: None,
) -> int:
    """One cell's round trip, rollout -> train -> rollout; returns the new policy version.

    rollout -> train: the engine sleeps (its weights and KV freed, sessions' token histories kept),
    the trainer's weights move to the device, ``train()`` runs the train phase and returns the new
    version. train -> rollout: the engine wakes with the trainer's weights as that version, the
    trainer is offloaded to host memory. ``mark(phase)`` is called after each phase ("slept",
    "trainer_on_device", "trained", "woke", "trainer_offloaded"); ``train`` may mark its own."""
    engine.sleep()
    mark("slept")
    worker.model.to(device)
    mark("trainer_on_device")
    version = train()
    mark("trained")
    engine.wake(worker.model.state_dict(), version)
    mark("woke")
    worker.model.zero_grad(set_to_none=True)
    worker.model.to("cpu")
    free(device)
    mark("trainer_offloaded")
    return version


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
    figures.update(
        preset=plan.switch_preset,
        session_context_tokens=len(history),
        micro_batch_tokens=len(sequence),
        trainer_offload="weights moved to host memory (pageable) between train phases",
        goals_s=GOALS_S,
        cycles=[],
    )
    marks: dict[str, float] = {}  # phase -> device-synchronized perf_counter, per cycle

    def mark(phase: str) -> None:
        marks[phase] = device_clock(device)

    for cycle in range(2):  # the first is cold (first transfers, kernels); the second is reported
        if cycle and time.monotonic() > deadline:
            figures.setdefault("skipped", []).append("warm cycle: the section's time ran out")
            break
        marks.clear()
        mark("start")

        def train(cycle: int = cycle) -> int:
            worker.reset()
            worker.accumulate(sequence, n_executions, 0, cycle)
            mark("first_micro_batch")
            with torch.no_grad():  # the optimizer step (not timed): the trainer now holds NEW weights
                for param in worker.params:
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-1e-3)
            return cycle + 1

        switch_cycle(engine, worker, device, train, mark)
        t0, t1, t2, t3 = (marks[k] for k in ("start", "slept", "trainer_on_device", "first_micro_batch"))
        u0, u1, u2 = (marks[k] for k in ("trained", "woke", "trainer_offloaded"))
        history = history + [rng.randrange(engine_model.config.vocab_size) for _ in range(8)]
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
        u3 = device_clock(device)
        probe = next(iter(worker.model.state_dict()))
        fresh = torch.equal(engine.runner.model.state_dict()[probe].cpu(), worker.model.state_dict()[probe])
        history = history + out.output_ids
        figures["cycles"].append(
            {
                "rollout_to_train_s": round(t3 - t0, 4),
                "sleep_s": round(t1 - t0, 4),
                "trainer_to_device_s": round(t2 - t1, 4),
                "first_micro_batch_s": round(t3 - t2, 4),
                "train_to_rollout_s": round(u3 - u0, 4),
                "wake_s": round(u1 - u0, 4),
                "trainer_offload_s": round(u2 - u1, 4),
                "first_token_s": round(u3 - u2, 4),
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
    del engine, engine_model
