"""Placement: which cells serve rollouts and which train, asked by a step at each phase.

    phase = Colocate().rollout(services, serving)    # engines that take this step's executions
    phase = Colocate().training(services, serving)   # engines put to sleep, the trainer's threads and devices

This is the seam the elastic scheduler takes over (it will answer from its own state); ``Colocate``
is the baseline every framework ships: the whole pool rolls out, then the whole pool trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engines.devices import CellDevices
from stack.campaign import Services, ServingConfig, live_engine_urls


@dataclass(frozen=True)
class Phase:
    serving: list[str]  # engine URLs awake, taking executions' calls
    sleeping: list[str]  # engine URLs asleep: their cells train
    trainer_threads: int
    trainer: CellDevices | None = None  # the trainer process's devices (ServingConfig.trainer_cell)


class Placement(Protocol):
    def rollout(self, services: Services, serving: ServingConfig) -> Phase: ...

    def training(self, services: Services, serving: ServingConfig) -> Phase: ...


class Colocate:
    """The whole pool rolls out, then the whole pool trains (engines asleep, their memory freed)."""

    def rollout(self, services: Services, serving: ServingConfig) -> Phase:
        return Phase(serving=live_engine_urls(services), sleeping=[], trainer_threads=0)

    def training(self, services: Services, serving: ServingConfig) -> Phase:
        return Phase(
            serving=[],
            sleeping=live_engine_urls(services),
            trainer_threads=serving.trainer_threads,
            trainer=serving.trainer_cell(),  # the whole pool trains: in no one cell's CPU quota
        )
