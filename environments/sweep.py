"""What a dispatcher leaves behind so that the next one can clean up after it if it dies.

A dispatcher writes its pid in an owner file in each of its temporary folders (``own``) and records
each harness it starts (the leader of its own process group, with its start time) in a file next to
it (``record_harness`` / ``forget_harness``). A dispatcher SIGKILLed mid-batch never runs its cleanup:
``sweep_dead_dispatchers`` (which every dispatcher runs before it starts) kills the harnesses of
dispatchers whose process is gone, releases their sandboxes' quota mounts and removes their folders.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path

from environments.sandbox_host import release_mounts

log = logging.getLogger(__name__)


OWNER_FILE = ".gyre-dispatcher"
"""In a dispatcher's temporary folders: its pid, so a later dispatcher can tell they were left."""
HARNESS_FILE = ".gyre-harnesses"
"""Next to the owner file of a dispatcher's harness folder: one line ``<pgid> <start time>`` per
harness still running, so a later dispatcher can kill the harnesses of one that was SIGKILLed."""


def own(folder: str | Path) -> None:
    Path(folder, OWNER_FILE).write_text(str(os.getpid()))


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid, it names one process for
    good, so a pid reused by another process is told apart. None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # after the command name, which may hold spaces


def record_harness(folder: str | Path, pgid: int) -> None:
    """Adds a harness (the leader of its own process group) to ``folder``'s HARNESS_FILE."""
    started = start_time(pgid)
    if started is not None:  # always, on Linux: a harness that already exited is a zombie until waited
        with open(Path(folder, HARNESS_FILE), "a") as records:
            records.write(f"{pgid} {started}\n")


def forget_harness(folder: str | Path, pgid: int) -> None:
    """Drops an ended (and waited) harness from HARNESS_FILE: its pid may be reused from now on.
    Written aside then renamed, so a dispatcher killed meanwhile leaves the whole list."""
    path = Path(folder, HARNESS_FILE)
    with contextlib.suppress(OSError):
        kept = [line for line in path.read_text().splitlines() if line.split()[:1] != [str(pgid)]]
        Path(f"{path}.new").write_text("".join(f"{line}\n" for line in kept))
        os.replace(f"{path}.new", path)


def _kill_harnesses(folder: Path) -> int:
    """SIGKILLs the process groups a dead dispatcher recorded in ``folder``'s HARNESS_FILE; returns
    how many. A group is killed when its leader is the recorded process (same start time) or is gone:
    a pid is never reused while a group of that id has members, so they are the harness's own. A
    leader with another start time is a reused pid: left alone."""
    try:
        lines = (folder / HARNESS_FILE).read_text().splitlines()
    except OSError:
        return 0
    killed = 0
    for line in lines:
        try:
            pgid, started = (int(part) for part in line.split())
        except ValueError:
            continue
        if start_time(pgid) not in (None, started):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            killed += 1
    return killed


def sweep_dead_dispatchers(parent: str | Path | None = None) -> int:
    """Kills the harnesses of, releases the quota mounts of, and removes the temporary workspace
    and harness folders of dispatchers whose process is gone (SIGKILLed: their cleanup never ran; a
    hanging harness would hold its CPU and sandbox for good; a tmpfs holds its files in memory);
    returns how many folders. Folders of live dispatchers, or with no owner, are kept untouched."""
    parent = Path(parent or tempfile.gettempdir())
    swept = killed = 0
    for folder in sorted([*parent.glob("gyre-workspaces-*"), *parent.glob("gyre-harness-*")]):
        try:
            pid = int((folder / OWNER_FILE).read_text())
            os.kill(pid, 0)
            continue  # alive (or reused by another process: kept, the safe side)
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue
        killed += _kill_harnesses(folder)
        release_mounts(folder)
        shutil.rmtree(folder, ignore_errors=True)
        swept += 1
    if swept:
        log.warning(
            "killed %d harnesses, released and removed %d folders of dispatchers that died", killed, swept
        )
    return swept
