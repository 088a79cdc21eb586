"""The grading copy: what of an agent's workspace a grader sees.

Grading never runs in the agent's workspace. ``grading_copy`` builds a fresh folder from it, taking
only what the agent may change (``Problem.editable``), and ``restore_template`` then puts the
template's version of every template file that was not taken back in place. Hidden files are
written over the result by the grader (grading.py ``place_hidden_file``).

What is taken (``Taker``):

- with ``editable = None`` (the default): every regular file and in-workspace symlink, except the
  hidden test paths (the hidden files themselves and the deepest folder holding all of them, unless
  they lie at the root), dot-files and dot-folders, packaging metadata (``*.dist-info``,
  ``*.egg-info``, ``*.pth``) and byte code (``__pycache__``, ``*.pyc``): the places a Python tool
  looks for plugins, start-up hooks and configuration rather than for the code under test;
- with ``editable = [patterns]``: the paths one of the glob patterns matches (``fnmatch``: ``*``
  crosses ``/``; a pattern that matches a folder takes everything below it), still never the hidden
  paths or byte code.

Every copy is bounded and never fails on what the agent left: FIFOs, sockets and devices are
skipped (reading a FIFO would block), symlinks leading out of the workspace are dropped, and each
path's bytes count against ``max_bytes`` as read, so hard links to one large file (which a tmpfs
quota counts once) cannot make the copy unbounded; files beyond the budget, or beyond
``max_entries`` names, are skipped. Every skip is a line of the returned notes (the grade log).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from environments.problems.problem import Problem, write_text

GRADE_COPY_BYTES = 256 << 20
"""Bytes of files a grading copy takes (each hard link counted as its own file)."""
GRADE_COPY_ENTRIES = 50_000
"""Files, folders and links a grading copy looks at."""
PACKAGING_SUFFIXES = (".dist-info", ".egg-info", ".pth")
NOTES_SHOWN = 20
"""Skipped paths named one by one in the notes (the rest are counted)."""


def hidden_folder(problem: Problem) -> str | None:
    """The deepest folder holding every hidden file (``tests`` for tests/ landing in tests/); None
    when they lie at the workspace root or there are none."""
    parents = [PurePosixPath(rel).parent.as_posix() for rel in problem.hidden_tests]
    if not parents or "." in parents:
        return None
    common = os.path.commonpath(parents)
    return common or None


@dataclass
class Taker:
    """Decides which workspace paths a grading copy takes (see the module docstring)."""

    editable: list[str] | None
    hidden: frozenset[str]
    hidden_dir: str | None

    @classmethod
    def of(cls, problem: Problem) -> Taker:
        return cls(problem.editable, frozenset(problem.hidden_tests), hidden_folder(problem))

    def _hidden(self, rel: str) -> bool:
        if rel in self.hidden:
            return True
        return self.hidden_dir is not None and (
            rel == self.hidden_dir or rel.startswith(self.hidden_dir + "/")
        )

    def descends(self, rel: str) -> bool:
        """Whether the copy looks inside the folder ``rel`` at all."""
        name = rel.rsplit("/", 1)[-1]
        if self._hidden(rel) or name == "__pycache__":
            return False
        if self.editable is None:
            return not name.startswith(".") and not name.endswith(PACKAGING_SUFFIXES)
        return True

    def takes(self, rel: str) -> bool:
        """Whether the copy takes the file or link ``rel`` (its folders already passed ``descends``)."""
        name = rel.rsplit("/", 1)[-1]
        if self._hidden(rel) or name.endswith(".pyc"):
            return False
        if self.editable is None:
            return not name.startswith(".") and not name.endswith(PACKAGING_SUFFIXES)
        parts = rel.split("/")
        prefixes = ["/".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(p, pattern) for pattern in self.editable for p in prefixes)


@dataclass
class CopyBudget:
    """What a copy may still read; every skip it caused is noted."""

    max_bytes: int = GRADE_COPY_BYTES
    max_entries: int = GRADE_COPY_ENTRIES
    used_bytes: int = 0
    entries: int = 0
    skipped: list[str] = field(default_factory=list)

    def note(self, rel: str, why: str) -> None:
        self.skipped.append(f"{rel} ({why})")

    def notes(self) -> list[str]:
        shown = self.skipped[:NOTES_SHOWN]
        more = len(self.skipped) - len(shown)
        return [f"skipped {s}" for s in shown] + ([f"skipped {more} more"] if more > 0 else [])


def grading_copy(problem: Problem, source: Path, dest: Path, budget: CopyBudget | None = None) -> list[str]:
    """Copies what the grader may see of ``source`` into the new folder ``dest`` (module docstring),
    restores the template's version of what was not taken, and returns the notes for the grade log.
    Never raises for what the workspace holds."""
    budget = budget or CopyBudget()
    taker = Taker.of(problem)
    root = source.resolve()
    dest.mkdir(parents=True)
    taken: set[str] = set()
    _copy_folder(root, root, dest, taker, budget, taken)
    restored = restore_template(problem, root, dest, taken, taker)
    notes = budget.notes()
    if restored:
        notes.append("template version of " + ", ".join(restored[:NOTES_SHOWN]))
    return notes


def _copy_folder(
    root: Path, folder: Path, dest: Path, taker: Taker, budget: CopyBudget, taken: set[str]
) -> None:
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        budget.note(folder.relative_to(root).as_posix() or ".", f"unreadable: {exc.strerror}")
        return
    for name in names:
        full = folder / name
        rel = full.relative_to(root).as_posix()
        budget.entries += 1
        if budget.entries > budget.max_entries:
            budget.note(rel, f"more than {budget.max_entries} entries")
            return
        try:
            info = os.lstat(full)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode):
            if taker.descends(rel):
                (dest / rel).mkdir(exist_ok=True)
                _copy_folder(root, full, dest, taker, budget, taken)
        elif stat.S_ISLNK(info.st_mode):
            if taker.takes(rel) and _copy_link(root, full, dest / rel):
                taken.add(rel)
            elif taker.takes(rel):
                budget.note(rel, "a link leading out of the workspace")
        elif stat.S_ISREG(info.st_mode):
            if not taker.takes(rel):
                continue
            if budget.used_bytes + info.st_size > budget.max_bytes:
                budget.note(rel, f"the copy's {budget.max_bytes} bytes were used up")
                continue
            budget.used_bytes += info.st_size
            if _copy_file(full, dest / rel, info.st_size):
                taken.add(rel)
        else:
            budget.note(rel, "not a regular file, folder or link")


def _copy_link(root: Path, link: Path, target_path: Path) -> bool:
    """Copies a symlink that stays inside the workspace (as the relative link it resolves to)."""
    target = link.resolve()
    if target != root and not target.is_relative_to(root):
        return False
    os.symlink(os.path.relpath(target, link.parent.resolve()), target_path)
    return True


def _copy_file(source: Path, target: Path, size: int) -> bool:
    """Copies at most ``size`` bytes (what the budget counted), never through a link."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as handle:
        mode = 0o755 if os.fstat(fd).st_mode & 0o111 else 0o644
        out_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(out_fd, "wb") as out:
            left = size
            while left > 0 and (chunk := handle.read(min(left, 1 << 20))):
                out.write(chunk)
                left -= len(chunk)
    return True


def restore_template(problem: Problem, source: Path, dest: Path, taken: set[str], taker: Taker) -> list[str]:
    """Writes the template's version of every template file the copy did not take (not editable,
    skipped, or not a regular file); an editable file the agent deleted stays deleted."""
    restored = []
    for rel, text in sorted(problem.files.items()):
        if rel in taken or rel in problem.hidden_tests:
            continue
        editable = taker.takes(rel) and _taken_folder(rel, taker)
        if editable and not os.path.lexists(source / rel):
            continue
        _clear_path(dest, rel)
        write_text(dest, rel, text)
        restored.append(rel)
    return restored


def _taken_folder(rel: str, taker: Taker) -> bool:
    parts = rel.split("/")
    return all(taker.descends("/".join(parts[:depth])) for depth in range(1, len(parts)))


def _clear_path(root: Path, rel: str) -> None:
    """Removes whatever stands on ``rel`` or blocks its folders (a link, a file where a folder goes)."""
    current = root
    parts = PurePosixPath(rel).parts
    for index, part in enumerate(parts):
        current = current / part
        last = index == len(parts) - 1
        if current.is_symlink() or (current.is_file() and not last):
            current.unlink()
        elif last and current.is_dir():
            shutil.rmtree(current)
