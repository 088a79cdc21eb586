"""The hardware one process of a cell gets, and the environment that gives it to the process.

A cell (DESIGN.md section 1) owns GPUs, or on CPU a thread budget and optionally named cores. Every
process of a cell (its rollout engine, its trainer replica, the core trainer of cell 0) is started
with the environment ``process_env`` computes from its `CellDevices`; every spawner uses it
(stack/up.py and stack.py for engines, tasks/train.py for the trainer, scheduler/cells.py
for replicas), so a cell's process sees the same thing however it was started:

    cell = CellDevices(gpus=[2, 3], threads=4, cores=[8, 9, 10, 11])
    env = process_env(cell)   # CUDA_VISIBLE_DEVICES=2,3  OMP_NUM_THREADS=4  MKL_NUM_THREADS=4
                              # GYRE_CPU_CORES=8,9,10,11
                              # (GYRE_CPU_CGROUP: its cell's cgroup, cpu_quota.py)
    subprocess.Popen(command, env={**os.environ, **env})

With CUDA_VISIBLE_DEVICES set to its cell's GPUs a process uses ``cuda:0`` (the cell's first GPU)
and never sees another cell's. The process itself calls ``settings.enter_cell()`` once at start, before it
starts threads: it joins its cell's CPU cgroup (GYRE_CPU_CGROUP: the cell's quota, cpu_quota.py),
pins itself to GYRE_CPU_CORES (os.sched_setaffinity; threads started later inherit it) and sets
torch's thread count from OMP_NUM_THREADS. ``settings.report()`` says what a process
got (an engine's /admin/stats, a replica's ready message), read back by tests/test_devices.py.

settings.py is the one module that reads these variables.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

CORES_VAR = "GYRE_CPU_CORES"
CGROUP_VAR = "GYRE_CPU_CGROUP"


class CellDevices(BaseModel):
    """What one process of a cell gets."""

    gpus: list[int] | None = Field(
        None, description="GPU indices (CUDA_VISIBLE_DEVICES); None: inherited from the starting process"
    )
    threads: int = Field(1, ge=1, description="OMP_NUM_THREADS, MKL_NUM_THREADS and torch threads")
    cores: list[int] | None = Field(
        None, description="CPU cores the process is pinned to (os.sched_setaffinity); None: not pinned"
    )
    cgroup: list[str] | None = Field(
        None,
        description="the cell's CPU cgroup folders (engines/devices/cpu_quota.py: its quota, one folder per "
        "hierarchy): the process joins them at its start, and what it starts is born there; None: none",
    )


class DevicesReport(BaseModel):
    """What a running process got: its visible GPUs, torch threads and the cores it may run on."""

    cuda_visible_devices: str | None = None
    threads: int = 1
    cores: list[int] = []


def process_env(cell: CellDevices) -> dict[str, str]:
    """The variables a process of ``cell`` is started with (added to the starting process's)."""
    threads = str(cell.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if cell.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in cell.gpus)
    if cell.cores is not None:
        env[CORES_VAR] = ",".join(str(core) for core in cell.cores)
    if cell.cgroup is not None:
        env[CGROUP_VAR] = os.pathsep.join(cell.cgroup)
    return env
