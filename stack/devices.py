"""Which devices each cell of `[serving]` owns: the checks of its layout, and each process's share.

    [serving]
    engines = 3
    devices = [[0], [1], [2, 3]]     # the GPUs of each cell: cell i is engine-i (and its replica)
    tensor_parallel_size = 1         # GPUs one model replica spans; divides every cell's count
    cores = [[0, 1], [2, 3], [4, 5]] # on CPU, optionally: the cores each cell's processes run on

``engine_cell(serving, i)`` is what engine-i (and, under the scheduler, cell i's trainer replica)
gets; ``trainer_cell(serving)`` what the trainer process gets (by default the core cell's, cell 0's,
devices and cores, with ``trainer_threads``). engines/devices.py turns either into a process's
environment.
"""

from __future__ import annotations

from typing import Protocol

from engines.devices import CellDevices


class ServingConfig(Protocol):
    """The keys of `[serving]` (stack/up.py ServingConfig) a layout is made of."""

    engines: int
    engine_threads: int
    trainer_threads: int
    devices: list[list[int]]
    tensor_parallel_size: int
    cores: list[list[int]]
    trainer_devices: list[int] | None
    trainer_cores: list[int] | None


def _overlaps(cells: list[list[int]], key: str, what: str) -> None:
    owner: dict[int, int] = {}
    for index, cell in enumerate(cells):
        if not cell:
            raise ValueError(f"{key}: cell {index} names no {what}; every cell needs at least one")
        for item in cell:
            if item in owner:
                where = (
                    f"cell {owner[item]} and cell {index}" if owner[item] != index else f"cell {index} twice"
                )
                raise ValueError(f"{key}: {what} {item} is in {where}; a {what} belongs to one cell")
            owner[item] = index


def check_layout(serving: ServingConfig) -> None:
    """Refuses a layout that cannot be placed, naming the key: overlapping cells, a tensor-parallel
    size that does not divide a cell's GPU count, more (or fewer) cells than engines."""
    for key, cells, what in (("devices", serving.devices, "GPU"), ("cores", serving.cores, "core")):
        if not cells:
            continue
        if len(cells) > serving.engines:
            raise ValueError(
                f"{key} names {len(cells)} cells but engines = {serving.engines}: one cell per engine "
                f"(cell i hosts engine-i); set engines = {len(cells)} or name {serving.engines} cells"
            )
        if len(cells) < serving.engines:
            raise ValueError(
                f"{key} names {len(cells)} cells but engines = {serving.engines}: name one cell per engine"
            )
        _overlaps(cells, key, what)
    tp = serving.tensor_parallel_size
    for index, cell in enumerate(serving.devices):
        if len(cell) % tp:
            raise ValueError(
                f"tensor_parallel_size = {tp} does not divide cell {index}'s {len(cell)} GPUs "
                f"(devices[{index}] = {cell}): give every cell a multiple of {tp} GPUs"
            )
    for key, items in (
        ("trainer_devices", serving.trainer_devices),
        ("trainer_cores", serving.trainer_cores),
    ):
        if items is not None:
            _overlaps([items], key, "GPU" if key == "trainer_devices" else "core")


def engine_cell(serving: ServingConfig, index: int) -> CellDevices:
    """What engine-``index`` (cell ``index``) gets: its GPUs and cores, ``engine_threads`` threads."""
    return CellDevices(
        gpus=serving.devices[index] if serving.devices else None,
        cores=serving.cores[index] if serving.cores else None,
        threads=serving.engine_threads,
    )


def trainer_cell(serving: ServingConfig) -> CellDevices:
    """What the trainer process gets: ``trainer_devices`` / ``trainer_cores`` when set, else the core
    cell's (cell 0's), and ``trainer_threads`` threads."""
    core = engine_cell(serving, 0)
    return CellDevices(
        gpus=serving.trainer_devices if serving.trainer_devices is not None else core.gpus,
        cores=serving.trainer_cores if serving.trainer_cores is not None else core.cores,
        threads=serving.trainer_threads,
    )
