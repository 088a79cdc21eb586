"""What a cell's process reads from its environment (the variables engines/devices process_env sets),
at its start and when asked what it got:

    CUDA_VISIBLE_DEVICES   its cell's GPUs (read by CUDA itself; reported here)
    OMP_NUM_THREADS        its thread budget (torch.set_num_threads)
    GYRE_CPU_CORES         the cores it pins itself to (os.sched_setaffinity), e.g. "0,1"
    GYRE_CPU_CGROUP        its cell's CPU cgroup folders (os.pathsep between them): it joins them
"""

from __future__ import annotations

import logging
import os

from engines.devices import CGROUP_VAR, CORES_VAR, DevicesReport
from engines.devices.cpu_quota import join_dirs

log = logging.getLogger(__name__)


def enter_cell(env: dict[str, str] | None = None, *, torch_threads: bool = True) -> None:
    """Called once by a cell's process at its start, before it starts threads or touches CUDA. ``env``:
    ``process_env``'s variables for a process that was not exec'd with them (a multiprocessing
    child: they are set here first); None reads those it was started with. ``torch_threads`` False: a
    process without torch (the vLLM adapter, whose vLLM child reads OMP_NUM_THREADS itself)."""
    if env is not None:
        os.environ.update(env)
    cgroup = os.environ.get(CGROUP_VAR)
    if cgroup:  # the cell's CPU quota: this process and all it starts from now on count against it
        try:
            join_dirs(cgroup.split(os.pathsep), os.getpid())
        except OSError as exc:  # the cell's share is not enforced on this process; it still runs
            log.warning(
                "could not join the cell's CPU cgroup %s (%s): this process is not in its quota", cgroup, exc
            )
    cores = os.environ.get(CORES_VAR)
    if cores:
        os.sched_setaffinity(0, {int(core) for core in cores.split(",")})
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and torch_threads:
        import torch

        torch.set_num_threads(int(threads))


def report(*, torch_threads: bool = True) -> DevicesReport:
    """What this process got (its environment, torch's thread count, its CPU affinity). ``torch_threads``
    False: the thread budget as OMP_NUM_THREADS gives it (a process without torch)."""
    if torch_threads:
        import torch

        threads = torch.get_num_threads()
    else:
        threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    return DevicesReport(
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        threads=threads,
        cores=sorted(os.sched_getaffinity(0)),
    )
