"""Cells that own their CPU: a cgroup per cell with its share as quota (engines/devices/cpu_quota.py).

Real cgroups on this machine (v1 cpu + cpuacct here, v2 cpu.max elsewhere; root needed): a cell's
cgroup has its quota and its processes (read back from /proc/<pid>/cgroup), a busy process cannot
use more than its cell's share even when the other cell is idle (usage read from the cgroup, over
the seconds it ran: a ratio, not a wall time), the folders go when the run ends or when its process
died, and a machine that refuses says so once and runs without. The last test builds the real
scheduling benchmark's stack and cells (bench/schedule_real.py RealBench) partitioned.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.devices import CellDevices
from engines.devices.cpu_quota import (
    TOP,
    CpuPartition,
    cell_shares,
    cpu_partition,
    find_hierarchy,
    sweep_dead_runs,
)
from tests.campaign_fixtures import tiny_policy


def _usable() -> str | None:
    """Why real cgroups cannot be made here (None: they can)."""
    partition = CpuPartition.create("probe", {"cell-0": 0.5})
    try:
        return None if partition.partitioned else "no writable cgroup cpu controller (root needed)"
    finally:
        partition.remove()


WHY_NOT = _usable()
needs_cgroups = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

BUSY = [sys.executable, "-c", "while True: pass"]


def _cgroup_of(pid: int, controller: str = "cpu") -> str:
    """The cgroup path of ``pid`` in the hierarchy of ``controller`` (v2: the unified one)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controllers == "" and find_hierarchy().version == 2):
            return path
    raise AssertionError(f"process {pid} is in no {controller} cgroup")


def _cores_used(partition: CpuPartition, seconds: float) -> dict[str, float]:
    """Each cell's CPU use over ``seconds``, in cores (CPU seconds per second)."""
    before, started = partition.usage_s(), time.monotonic()
    time.sleep(seconds)
    after, elapsed = partition.usage_s(), time.monotonic() - started
    return {cell: (after[cell] - before[cell]) / elapsed for cell in before}  # type: ignore[operator]


@pytest.fixture
def two_cells():
    partition = CpuPartition.create("test", {"cell-0": 0.5, "cell-1": 0.5})
    started: list[subprocess.Popen] = []
    yield partition, started
    for process in started:
        process.kill()
        process.wait()
    partition.remove()


def _start(started: list[subprocess.Popen], command: list[str]) -> subprocess.Popen:
    process = subprocess.Popen(command, stdin=subprocess.PIPE)
    started.append(process)
    return process


@needs_cgroups
def test_a_cells_cgroup_has_its_quota_and_its_processes_and_their_children(two_cells):
    partition, started = two_cells
    cell = partition.cells["cell-0"]
    assert partition.partitioned and cell.quota() == 0.5
    if cell.hierarchy.version == 1:
        assert (cell.dirs[0] / "cpu.cfs_period_us").read_text().strip() == "100000"
        assert (cell.dirs[0] / "cpu.cfs_quota_us").read_text().strip() == "50000"
    shell = _start(started, ["sh", "-c", "read line; sleep 60 & wait"])
    cell.join(shell.pid)
    shell.stdin.write(b"go\n")  # type: ignore[union-attr]
    shell.stdin.flush()  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while len(cell.pids()) < 2 and time.monotonic() < deadline:  # the child it starts after joining
        time.sleep(0.05)
    (child,) = [pid for pid in cell.pids() if pid != shell.pid]
    expected = "/" + str(cell.dirs[0].relative_to(cell.hierarchy.cpu))
    assert expected.endswith("/cell-0") and f"/{TOP}/test." in expected
    assert _cgroup_of(shell.pid) == _cgroup_of(child) == expected
    if cell.hierarchy.version == 1 and cell.hierarchy.acct not in (None, cell.hierarchy.cpu):
        assert _cgroup_of(child, "cpuacct").endswith("/cell-0")  # where its usage is counted
    assert partition.cells["cell-1"].pids() == []
    os.kill(child, 9)


@needs_cgroups
def test_two_busy_cells_of_half_a_core_each_use_at_most_their_share(two_cells):
    partition, started = two_cells
    for cell_id in ("cell-0", "cell-1"):
        partition.cells[cell_id].join(_start(started, BUSY).pid)
    time.sleep(0.3)  # past the interpreter's start
    used = _cores_used(partition, 2.0)
    assert all(0.05 < cores <= 0.7 for cores in used.values()), used


@needs_cgroups
def test_an_idle_cells_share_is_not_available_to_the_other(two_cells):
    """One busy process in a 0.5-core cell stays at ~0.5 core with a free core beside it: the idle
    cell's share is lost, as an idle GPU is. Two busy processes outside any cell show the machine
    could give it more (it is not asserted: a loaded machine may not)."""
    partition, started = two_cells
    partition.cells["cell-0"].join(_start(started, BUSY).pid)
    time.sleep(0.3)
    used = _cores_used(partition, 2.0)
    assert 0.05 < used["cell-0"] <= 0.7, used
    assert used["cell-1"] < 0.05, used


@needs_cgroups
def test_removing_a_partition_moves_its_processes_out_and_removes_its_folders(two_cells):
    partition, started = two_cells
    sleeper = _start(started, ["sleep", "60"])
    partition.cells["cell-1"].join(sleeper.pid)
    folders = [d for cell in partition.cells.values() for d in cell.dirs] + partition.run_dirs
    assert all(folder.is_dir() for folder in folders)
    partition.remove()
    assert not any(folder.exists() for folder in folders)
    assert sleeper.poll() is None and _cgroup_of(sleeper.pid) == "/"  # alive, in the root


@needs_cgroups
def test_the_folders_of_a_run_whose_process_died_are_swept_at_the_next_start():
    dead = subprocess.Popen(["true"])
    dead.wait()
    hierarchy = find_hierarchy()
    left = [top / TOP / f"killed.{dead.pid}" / "cell-0" for top in hierarchy.roots()]
    for folder in left:
        folder.mkdir(parents=True)
    mine = hierarchy.cpu / TOP / f"alive.{os.getpid()}"
    mine.mkdir()
    try:
        assert sweep_dead_runs(hierarchy) >= 1
        assert not any(folder.parent.exists() for folder in left)
        assert mine.is_dir()  # a live process's run is kept
    finally:
        mine.rmdir()


HOST_PROBE = """
import json, os, subprocess, sys, time
from pathlib import Path
from engines.devices import CellDevices
from engines.devices.cpu_quota import cpu_partition

def cpu_cgroup():
    return next(l.split(":", 2)[2] for l in Path("/proc/self/cgroup").read_text().splitlines()
                if "cpu" in l.split(":")[1].split(",") or l.split(":")[1] == "")

out = {}
with cpu_partition("hostprobe", [CellDevices(), CellDevices()], host_cores=0.5) as partition:
    out["quotas"] = {k: c.quota() for k, c in partition.cells.items()}
    out["host_quota"] = partition.host.quota()
    out["inside"] = cpu_cgroup()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # born in the host's cgroup
    time.sleep(0.3)
    before, started = partition.host_usage_s(), time.monotonic()
    time.sleep(2.0)
    out["host_cores_used"] = (partition.host_usage_s() - before) / (time.monotonic() - started)
    busy.kill()
    busy.wait()
out["after"] = cpu_cgroup()
print(json.dumps(out))
"""


@needs_cgroups
def test_the_hosts_share_holds_the_process_that_made_it_and_what_it_starts(tmp_path):
    """host_cores: the process that makes the partition joins a `host` cgroup with that quota, what it
    starts later is born there and bounded by it, the cells share the rest of the cores, and the
    process is back in the root once the partition is gone (in a child process: the test's own worker
    is not throttled)."""
    result = subprocess.run(
        [sys.executable, "-c", HOST_PROBE], capture_output=True, text=True, timeout=60, cwd=os.getcwd()
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    total = len(os.sched_getaffinity(0))
    assert out["quotas"] == {"cell-0": (total - 0.5) / 2, "cell-1": (total - 0.5) / 2}
    assert out["host_quota"] == 0.5
    assert out["inside"].endswith("/host") and f"/{TOP}/hostprobe." in out["inside"]
    assert 0.05 < out["host_cores_used"] <= 0.7, out  # one busy process held to the host's half core
    assert out["after"] == "/"


def test_host_cores_must_leave_the_cells_a_core():
    cores = float(len(os.sched_getaffinity(0)))
    with (
        pytest.raises(ValueError, match="leaves no core to the cells"),
        cpu_partition("none", [CellDevices()], host_cores=cores),
    ):
        pass


def test_a_machine_that_refuses_says_so_once_and_the_cells_share_the_cores(caplog):
    with caplog.at_level(logging.WARNING, logger="engines.devices.cpu_quota"):
        partition = CpuPartition.create("test", {"cell-0": 0.5, "cell-1": 0.5}, root="/nonexistent/cgroup")
    assert not partition.partitioned and partition.usage_s() == {}
    (record,) = caplog.records
    assert "CELLS SHARE THE CORES" in record.getMessage() and "does not exist" in record.getMessage()
    cells = [CellDevices(), CellDevices()]
    assert partition.place(cells) == cells  # nothing to join
    partition.remove()


def test_a_cells_share_is_its_cores_or_the_machines_cores_over_the_cells():
    assert cell_shares([CellDevices(), CellDevices(), CellDevices(), CellDevices()], total=2) == [0.5] * 4
    assert cell_shares([CellDevices(cores=[0, 1]), CellDevices(cores=[2])], total=8) == [2.0, 1.0]


@needs_cgroups
@pytest.mark.slow
def test_the_real_benchmarks_cells_own_their_share(tmp_path):
    """bench/schedule_real.py's stack and pool, partitioned: each cell's engine and replica in its
    cell's cgroup (the core cell: its engine, and the core trainer's cell is its), the gateway and this
    process in the host's (HOST_CORES; the cells share the rest), usage read per cell, and the folders
    gone (this process back in the root) once the bench ends."""
    from bench.schedule_real import HOST_CORES, RealBench, cell_cpu_s

    policy = tiny_policy(tmp_path / "policy")
    with RealBench(str(tmp_path / "bench"), model=policy, cells=2) as bench:
        assert bench.partitioned
        partition = bench.stack.partition
        folders = [d for cell in partition.cells.values() for d in cell.dirs]
        assert partition.host is not None and partition.host.quota() == HOST_CORES
        folders += list(partition.host.dirs)
        gateway = bench.stack.processes[bench.stack.gateway_url].pid
        assert _cgroup_of(gateway).endswith("/host") and _cgroup_of(os.getpid()).endswith("/host")
        engines = [bench.stack.processes[url].pid for url in bench.stack.engine_urls]
        replica = bench.pool.cells["cell-1"].replica.process.pid  # type: ignore[union-attr]
        for cell_id, pids in (("cell-0", [engines[0]]), ("cell-1", [engines[1], replica])):
            assert sorted(partition.cells[cell_id].pids()) == sorted(pids)
            assert all(_cgroup_of(pid).endswith(f"/{cell_id}") for pid in pids)
            assert partition.cells[cell_id].quota() == pytest.approx(
                (len(os.sched_getaffinity(0)) - HOST_CORES) / 2
            )
        assert bench.core_cell().cgroup == [str(d) for d in partition.cells["cell-0"].dirs]
        used = bench.pool.cpu_usage_s()
        assert set(used) == {"cell-0", "cell-1"} and all(s and s > 0 for s in used.values())  # loading
        assert cell_cpu_s(used, bench.pool.cpu_usage_s()).keys() == used.keys()
        assert partition.host_usage_s() > 0  # the gateway's start
    assert not any(folder.exists() for folder in folders)
    assert _cgroup_of(os.getpid()) == "/"


def test_a_cells_processes_are_started_with_its_cgroup_and_a_campaigns_services_carry_them():
    """process_env names the cell's cgroup (the process joins it in enter_cell); a campaign's
    Services carry each cell's, so the scheduler's replicas and core trainer join their cell's."""
    from engines.devices import process_env
    from stack.campaign import Services

    cell = CellDevices(
        threads=2, cgroup=["/sys/fs/cgroup/cpu/gyre/r.1/cell-0", "/sys/fs/cgroup/cpuacct/gyre/r.1/cell-0"]
    )
    assert process_env(cell)["GYRE_CPU_CGROUP"] == os.pathsep.join(cell.cgroup)  # type: ignore[arg-type]
    assert "GYRE_CPU_CGROUP" not in process_env(CellDevices())
    services = Services(
        gateway_url="http://g",
        admin_token="a",
        engine_urls=["http://e0", "http://e1"],
        engine_admin_token="e",
        policy_root="/p",
        fast_dir="/f",
        cell_cgroups=[["/c0"], ["/c1"]],
    )
    assert services.in_cell(CellDevices(threads=3), 1) == CellDevices(threads=3, cgroup=["/c1"])
    unpartitioned = services.model_copy(update={"cell_cgroups": []})
    assert unpartitioned.in_cell(CellDevices(threads=3), 1) == CellDevices(threads=3)
