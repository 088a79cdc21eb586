"""A cell's CPU share as a control group with a quota: on CPU, a cell owns its share of the cores as
on a GPU host it owns its devices.

Without it, cells that share cores share them with the operating system's blessing: an idle cell's
CPU goes to whoever needs it, so a cell freed by the scheduler frees nothing. With a cgroup per cell
and a quota, an idle cell's share is lost as an idle GPU is, and a cell that switches from rollout to
training brings its share to training. The quota belongs to the cell, not to a process: every process
of the cell (its rollout engine, its trainer replica, the core trainer for the core cell, anything
they start later) is in the cell's cgroup, so the share follows the cell's role with no move at all.

    partition = CpuPartition.create("stack-1a2b", {"cell-0": 0.5, "cell-1": 0.5})
    cells = partition.place([CellDevices(), CellDevices()])   # each cell's processes join its cgroup
    ... start processes with process_env(cells[i]) ...        # settings.enter_cell joins at start
    partition.usage_s()                                       # {"cell-0": 12.3, "cell-1": 4.1}
    partition.remove()                                        # its processes to the root, rmdir

The host's share (``host_cores``): on a GPU host the gateway, the dispatcher and every harness with
the commands it runs use the host's CPUs, not the cells' devices. On CPU they would otherwise take
whatever the cells leave, so a quota that binds a cell would still leave the machine full and a freed
cell's share would go to them. With ``host_cores`` the partition also makes a ``host`` cgroup with that
quota and moves the process that made it there (what it starts later, the gateway and every harness,
is born there; a cell's processes move to their cell as they start), and the cells share the rest.

Folders: cgroup v1 ``<cpu mount>/gyre/<run>.<pid>/<cell>`` with ``cpu.cfs_period_us`` 100000 and
``cpu.cfs_quota_us`` = share x period (and the same folder under the cpuacct mount when cpuacct is a
hierarchy of its own: the usage is read there, ``cpuacct.usage``); cgroup v2 ``<mount>/gyre/<run>.<pid>/
<cell>`` with ``cpu.max`` and ``cpu.stat`` usage_usec. ``<pid>`` is the creating process's: a run
whose process died leaves folders that ``sweep_dead_runs`` (run by every ``create``) removes.

Where the machine refuses (no cgroup file system, not root, read-only), ``create`` says so once (one
warning naming why: the cells then share the cores) and returns a partition with no cells
(``partitioned`` False); nothing else changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engines.devices import CellDevices

log = logging.getLogger(__name__)

PERIOD_US = 100_000  # the quota's period: the share is quota / period cores
TOP = "gyre"  # every run's folders are under <hierarchy>/gyre/


@dataclass(frozen=True)
class Hierarchy:
    """Where cgroups of this machine are made: the cpu controller's root (quota), the root usage is
    read under (the same for v2 and a v1 mount of cpu,cpuacct), and the cgroup version."""

    cpu: Path
    acct: Path | None  # None: no usage (a v1 cpu hierarchy given without its cpuacct)
    version: int

    def roots(self) -> list[Path]:
        return [self.cpu] if self.acct in (None, self.cpu) else [self.cpu, self.acct]  # type: ignore[list-item]


def find_hierarchy(root: str | None = None) -> Hierarchy:
    """This machine's cgroup roots for CPU (``root``: the cpu controller's root, for a test or an
    unusual mount). Raises OSError naming what is missing."""
    if root is not None:
        path = Path(root)
        if not path.is_dir():
            raise FileNotFoundError(f"{root} does not exist")
        if (path / "cgroup.controllers").exists():
            return Hierarchy(path, path, 2)
        acct = path if (path / "cpuacct.usage").exists() else path.parent / "cpuacct"
        return Hierarchy(path, acct if (acct / "cpuacct.usage").exists() else None, 1)
    cpu = acct = unified = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            _, mount_point, fstype, options, *_ = line.split()
            controllers = options.split(",")
            if fstype == "cgroup" and "cpu" in controllers:
                cpu = Path(mount_point)
            if fstype == "cgroup" and "cpuacct" in controllers:
                acct = Path(mount_point)
            if fstype == "cgroup2":
                unified = Path(mount_point)
    if cpu is not None:
        return Hierarchy(cpu, acct, 1)
    if unified is not None:
        if "cpu" not in (unified / "cgroup.controllers").read_text().split():
            raise OSError(f"the cgroup v2 tree at {unified} has no cpu controller")
        return Hierarchy(unified, unified, 2)
    raise FileNotFoundError("no cgroup cpu controller is mounted (/proc/self/mounts)")


@dataclass(frozen=True)
class CellCgroup:
    """One cell's cgroup: a folder per hierarchy (the cpu one first), its quota, its processes."""

    cell_id: str
    dirs: tuple[Path, ...]
    hierarchy: Hierarchy

    def set_quota(self, cores: float) -> None:
        """The cell may use ``cores`` cores' worth of CPU time per period, on whichever cores."""
        quota = max(1000, round(cores * PERIOD_US))  # the kernel's smallest quota is 1 ms
        if self.hierarchy.version == 2:
            (self.dirs[0] / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (self.dirs[0] / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.dirs[0] / "cpu.cfs_quota_us").write_text(str(quota))

    def quota(self) -> float | None:
        """The cell's share in cores (None: no quota)."""
        if self.hierarchy.version == 2:
            quota, period = (self.dirs[0] / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota = int((self.dirs[0] / "cpu.cfs_quota_us").read_text())
        return None if quota < 0 else quota / int((self.dirs[0] / "cpu.cfs_period_us").read_text())

    def join(self, pid: int) -> None:
        """Moves process ``pid`` (all its threads) into the cell; what it starts later is born there."""
        join_dirs([str(d) for d in self.dirs], pid)

    def pids(self) -> list[int]:
        return [int(p) for p in (self.dirs[0] / "cgroup.procs").read_text().split()]

    def usage_s(self) -> float | None:
        """CPU seconds the cell's processes used since the cgroup was made (None: not readable)."""
        if self.hierarchy.version == 2:
            for line in (self.dirs[0] / "cpu.stat").read_text().splitlines():
                key, value = line.split()
                if key == "usage_usec":
                    return int(value) / 1e6
            return None
        if self.hierarchy.acct is None:
            return None
        return int((self.dirs[-1] / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        _remove_dirs(self.dirs, self.hierarchy)


def join_dirs(dirs: list[str], pid: int) -> None:
    """Moves ``pid`` into each of a cell's cgroup folders (CellDevices.cgroup)."""
    for folder in dirs:
        Path(folder, "cgroup.procs").write_text(str(pid))


def _remove_dirs(dirs: tuple[Path, ...] | list[Path], hierarchy: Hierarchy) -> None:
    """Moves what is still in each folder to its hierarchy's root (v2 allows no process in an inner
    folder with controllers, so the root for both), then removes it."""
    for folder in dirs:
        if not folder.is_dir():
            continue
        root = next((r for r in hierarchy.roots() if folder.is_relative_to(r)), None)
        for pid in _procs(folder):
            if root is not None:
                with contextlib.suppress(OSError):  # it may have ended meanwhile
                    (root / "cgroup.procs").write_text(str(pid))
        try:
            folder.rmdir()
        except OSError as exc:
            log.warning("could not remove the cell cgroup %s (%s)", folder, exc)


def _procs(folder: Path) -> list[int]:
    try:
        return [int(p) for p in (folder / "cgroup.procs").read_text().split()]
    except OSError:
        return []


class CpuPartition:
    """The CPU cgroups of one run's cells (a stack, a campaign), keyed by cell id. A partition with
    no cells (``partitioned`` False) is what a machine that refuses cgroups gets: every method works
    and does nothing."""

    def __init__(
        self,
        run_dirs: list[Path],
        cells: dict[str, CellCgroup],
        hierarchy: Hierarchy | None,
        host: CellCgroup | None = None,
    ):
        self.run_dirs, self.cells, self.hierarchy, self.host = run_dirs, cells, hierarchy, host

    @property
    def partitioned(self) -> bool:
        return bool(self.cells)

    @classmethod
    def none(cls) -> CpuPartition:
        return cls([], {}, None)

    @classmethod
    def create(
        cls, run_id: str, shares: dict[str, float], *, root: str | None = None, host_cores: float = 0.0
    ) -> CpuPartition:
        """A cgroup per cell of ``shares`` (cell id -> its share in cores) under ``gyre/<run_id>.<pid>``;
        the runs of dead processes are swept first. ``host_cores`` > 0: also a ``host`` cgroup with
        that quota, which this process joins (see the module docstring). Where the machine refuses:
        one warning, and a partition with no cells."""
        hierarchy = None
        made: list[Path] = []
        try:
            hierarchy = find_hierarchy(root)
            sweep_dead_runs(hierarchy)
            run = f"{run_id}.{os.getpid()}"
            run_dirs = []
            for top in hierarchy.roots():
                _make(top / TOP, made, hierarchy)
                run_dirs.append(_make(top / TOP / run, made, hierarchy))
            cells = {}
            for cell_id, cores in shares.items():
                dirs = tuple(_make(run_dir / cell_id, made, hierarchy, leaf=True) for run_dir in run_dirs)
                cells[cell_id] = CellCgroup(cell_id, dirs, hierarchy)
                cells[cell_id].set_quota(cores)
            host = None
            if host_cores > 0:
                host = CellCgroup(
                    "host", tuple(_make(d / "host", made, hierarchy, leaf=True) for d in run_dirs), hierarchy
                )
                host.set_quota(host_cores)
                host.join(os.getpid())
            return cls(run_dirs, cells, hierarchy, host)
        except OSError as exc:
            where = str(hierarchy.cpu) if hierarchy else (root or "/sys/fs/cgroup")
            log.warning(
                "CELLS SHARE THE CORES: could not give each cell a CPU cgroup under %s (%s); every "
                "cell's processes run on every core, so an idle cell's CPU goes to the others. "
                "Run as root where the cgroup cpu controller is writable, or set [serving] partition = 'none'",
                where,
                exc,
            )
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            return cls.none()

    def place(self, cells: list[CellDevices], ids: list[str] | None = None) -> list[CellDevices]:
        """``cells`` (cell i: ``cell-<i>`` unless ``ids``), each with its cgroup's folders: a process
        started with process_env of one joins that cell (engines/devices/settings.enter_cell)."""
        ids = ids or [f"cell-{i}" for i in range(len(cells))]
        return [
            cell.model_copy(update={"cgroup": [str(d) for d in self.cells[i].dirs]})
            if i in self.cells
            else cell
            for cell, i in zip(cells, ids, strict=True)
        ]

    def usage_s(self) -> dict[str, float | None]:
        """CPU seconds each cell used since it was made ({} when not partitioned)."""
        return {cell_id: cell.usage_s() for cell_id, cell in self.cells.items()}

    def host_usage_s(self) -> float | None:
        """CPU seconds the host's processes used since the partition was made (None: no host share)."""
        return None if self.host is None else self.host.usage_s()

    def remove(self) -> None:
        """Every cell's cgroup and the run's folder (their processes go to the root first)."""
        if self.hierarchy is None:
            return
        for cell in [*self.cells.values(), *([self.host] if self.host else [])]:
            cell.remove()
        _remove_dirs(self.run_dirs, self.hierarchy)
        self.cells, self.run_dirs, self.host = {}, [], None


def _make(folder: Path, made: list[Path], hierarchy: Hierarchy, *, leaf: bool = False) -> Path:
    """mkdir (kept when it exists); in v2, an inner folder hands the cpu controller to its children."""
    if not folder.is_dir():
        folder.mkdir()
        made.append(folder)
    if hierarchy.version == 2 and not leaf:
        if folder.parent == hierarchy.cpu:
            (hierarchy.cpu / "cgroup.subtree_control").write_text("+cpu")
        (folder / "cgroup.subtree_control").write_text("+cpu")
    return folder


def cell_shares(cells: list[CellDevices], total: float | None = None) -> list[float]:
    """Each cell's share in cores: its ``cores`` when the layout names them, else the machine's cores
    (``total``: those this process may run on) over the cells."""
    total = total or len(os.sched_getaffinity(0))
    return [float(len(c.cores)) if c.cores else total / len(cells) for c in cells]


@contextlib.contextmanager
def cpu_partition(
    run_id: str, cells: list[CellDevices], *, root: str | None = None, host_cores: float = 0.0
) -> Iterator[CpuPartition]:
    """A partition of ``cells`` (``cell-<i>``, each its `cell_shares` of the cores ``host_cores`` leaves)
    for the block; removed after (this process back in the root when it had joined the host's)."""
    total = len(os.sched_getaffinity(0)) - host_cores
    if total <= 0:
        raise ValueError(
            f"host_cores {host_cores} leaves no core to the cells ({total + host_cores:g} cores here)"
        )
    shares = cell_shares(cells, total)
    partition = CpuPartition.create(
        run_id, {f"cell-{i}": s for i, s in enumerate(shares)}, root=root, host_cores=host_cores
    )
    try:
        yield partition
    finally:
        partition.remove()


@contextlib.contextmanager
def cell_quota(cell_id: str, cores: float | None) -> Iterator[CpuPartition]:
    """One cell's cgroup with a quota of ``cores`` for the block (a cell on a host of [cluster]:
    stack/cell.py), removed after; ``cores`` None: no partition."""
    partition = CpuPartition.create(cell_id, {cell_id: cores}) if cores else CpuPartition.none()
    try:
        yield partition
    finally:
        partition.remove()


def sweep_dead_runs(hierarchy: Hierarchy) -> int:
    """Removes the run folders (``<run>.<pid>``) of processes that are gone (killed: their cleanup
    never ran), moving what is left in them to the root; returns how many. Runs of live processes,
    and folders not named so, are kept."""
    swept = 0
    for top in hierarchy.roots():
        runs = [d for d in (top / TOP).iterdir() if d.is_dir()] if (top / TOP).is_dir() else []
        for run in sorted(runs):
            try:
                os.kill(int(run.name.rsplit(".", 1)[1]), 0)
                continue  # alive (or a reused pid: kept, the safe side)
            except ProcessLookupError:
                pass
            except (OSError, ValueError):
                continue
            _remove_dirs([d for d in run.iterdir() if d.is_dir()], hierarchy)
            _remove_dirs([run], hierarchy)
            swept += 1
    if swept:
        log.warning("removed %d cell cgroup folders of runs whose process died", swept)
    return swept
