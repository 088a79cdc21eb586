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

Every copy is bounded and never fails on what the agent left: it walks with
environments/workspace_tree.py ``walk`` (no recursion, no link followed, at most ``MAX_DEPTH``
folders deep; names no store could keep, a backslash, a control character or bytes that are not
UTF-8, are left out, as the snapshot leaves them out), FIFOs, sockets and devices are skipped
(reading a FIFO would block), symlinks leading out of the workspace or in a loop are dropped, and
each path's bytes count against ``max_bytes`` as read, so hard links to one large file (which a tmpfs
quota counts once) cannot make the copy unbounded; files beyond the budget, or beyond
``max_entries`` names, are skipped. Every skip is a line of the returned notes (the grade log).
"""

from __future__ import annotations

import fnmatch
import importlib.machinery
import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath

from environments.problems.problem import Problem, write_text
from environments.workspace_tree import link_inside, printable, remove_tree, walk

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
    skipped: list[str] = field(default_factory=list)

    def note(self, rel: str, why: str) -> None:
        self.skipped.append(f"{printable(rel)} ({why})")

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
    root = os.path.realpath(source)
    dest.mkdir(parents=True)
    taken: set[str] = set()
    for found in walk(root, budget.note, descend=taker.descends, max_entries=budget.max_entries):
        rel = found.rel
        if found.is_dir:
            if taker.descends(rel):
                (dest / rel).mkdir(exist_ok=True)
        elif not taker.takes(rel):
            continue
        elif found.is_link:
            target = link_inside(root, found.path)
            if target is None:
                budget.note(rel, "a link leading out of the workspace, or in a loop")
            else:
                os.symlink(target, dest / rel)
                taken.add(rel)
        elif found.is_file:
            size = found.info.st_size
            if budget.used_bytes + size > budget.max_bytes:
                budget.note(rel, f"the copy's {budget.max_bytes} bytes were used up")
                continue
            budget.used_bytes += size
            if _copy_file(Path(found.path), dest / rel, size):
                taken.add(rel)
            else:
                budget.note(rel, "a file that cannot be read")
        else:
            budget.note(rel, "not a regular file, folder or link")
    restored = restore_template(problem, Path(root), dest, taken, taker)
    notes = budget.notes()
    if restored:
        notes.append("template version of " + ", ".join(restored[:NOTES_SHOWN]))
    return notes


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
            remove_tree(current)


# ------------------------------------------------------------------------ what tools read themselves

PYTEST_CONFIG_NAMES = (
    "pytest.toml",
    ".pytest.toml",
    "pytest.ini",
    ".pytest.ini",
    "pyproject.toml",
    "tox.ini",
    "setup.cfg",
)
"""pytest's configuration files, in the order it looks for them in every folder from the arguments
up (pytest's docs, "Configuration file formats"; ``_pytest/config/findpaths.py`` ``locate_config``).
tests/test_folder_grading.py reads the names from the installed pytest's own source, so a pytest that
learns a new name fails the test until the name is here."""
PYTEST_PLUGIN_NAMES = ("conftest.py",)
"""Local plugins pytest imports from every folder it collects (docs: "conftest.py: local
per-directory plugins"), ``pytest_plugins`` lists included."""
PYTHON_STARTUP_NAMES = ("sitecustomize.py", "usercustomize.py")
"""Modules Python's ``site`` imports at start-up from the module path (docs: the site module)."""
NEUTRALISED_NAMES = frozenset(PYTEST_CONFIG_NAMES + PYTEST_PLUGIN_NAMES + PYTHON_STARTUP_NAMES)
"""Files a pinned tool reads as configuration or imports on its own, wherever they lie: in a grading
copy (pytest-based and command graders), any of these the agent wrote is removed and any it changed is
restored from the template (``neutralise``)."""
PATH_MARKERS = ("__init__.py", "setup.py")
"""Files that change how pytest sees the folders from the copy's root to the hidden tests: a package
marker makes pytest (8 and later) collect the folder as a ``Package`` and import its ``__init__.py``
even when the tests import nothing of the agent's (docs: "pytest import mechanisms and sys.path");
``setup.py`` makes its folder the rootdir when no configuration file is found (docs: "Initialization:
determining rootdir and configfile")."""


def neutralise(copy: Path, problem: Problem) -> list[str]:
    """Removes from a grading copy what could change how its grader runs; returns what it did.

    - ``NEUTRALISED_NAMES`` anywhere, and ``PATH_MARKERS`` in the root and in every folder on the
      way to a hidden file: the agent's are removed, ones it changed restored to the template's text;
    - ``__pycache__`` folders and ``.pyc`` files (byte code is compiled afresh from the sources the
      grader sees), and ``*.dist-info`` / ``*.egg-info`` folders (their entry points declare plugins).
    """
    template = problem.files
    markers = {_join(folder, name) for folder in _folders_to_hidden(problem) for name in PATH_MARKERS}
    actions = []
    for dirpath, dirnames, filenames in os.walk(copy):  # the copy is at most MAX_DEPTH deep
        for name in list(dirnames):
            if name == "__pycache__" or name.endswith((".dist-info", ".egg-info")):
                remove_tree(Path(dirpath, name))
                dirnames.remove(name)
                actions.append(f"removed {Path(dirpath, name).relative_to(copy).as_posix()}/")
        for name in filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(copy).as_posix()
            if name.endswith(".pyc"):
                path.unlink()
                actions.append(f"removed {rel}")
            elif name in NEUTRALISED_NAMES or rel in markers:
                if rel in problem.hidden_tests:
                    continue
                if rel in template and not path.is_symlink() and _read(path) == template[rel]:
                    continue
                path.unlink()
                if rel in template:
                    write_text(copy, rel, template[rel])
                    actions.append(f"restored {rel}")
                else:
                    actions.append(f"removed {rel}")
    return actions


def _folders_to_hidden(problem: Problem) -> set[str]:
    """The root ("") and every folder from it to a hidden file's folder."""
    folders = {""}
    for rel in problem.hidden_tests:
        parts = PurePosixPath(rel).parts[:-1]
        folders.update("/".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    return folders


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def unshadow_hidden_modules(copy: Path, problem: Problem) -> list[str]:
    """Removes what the import system would load in place of a hidden Python file ``dir/stem.py``:
    in the copy's root (first on a grade command's module path) and beside the hidden file, a
    package folder ``stem/``, a module ``stem.py`` and an extension module ``stem.<suffix>`` (Python's
    path finder takes a package folder and then an extension before the source file: every suffix
    of ``importlib.machinery.all_suffixes`` is tried)."""
    actions = []
    suffixes = importlib.machinery.all_suffixes()
    for rel in sorted(problem.hidden_tests):
        hidden = PurePosixPath(rel)
        if hidden.suffix != ".py" or hidden.stem == "__init__":
            continue
        beside = hidden.parent.as_posix()
        for folder in sorted({"", "" if beside == "." else beside}):
            for name in [hidden.stem, *(hidden.stem + suffix for suffix in suffixes)]:
                shadow_rel = _join(folder, name)
                shadow = copy / shadow_rel
                if shadow_rel in problem.hidden_tests or not os.path.lexists(shadow):
                    continue
                remove_tree(shadow)
                actions.append(f"removed {shadow_rel} (it shadows the hidden {rel})")
    return actions


GRADE_TOOLS = ("pytest",)
"""Distributions a grade command's interpreter runs (``python -m pytest``), with what they require."""


@cache
def tool_modules() -> frozenset[str]:
    """Top-level modules a grade command's interpreter may import besides the code under test: the
    standard library (``sys.stdlib_module_names``), the start-up hooks (a ``sitecustomize/`` package
    or extension is imported like the file), and the packages of ``GRADE_TOOLS`` and of every
    distribution they require, as installed here."""
    wanted: set[str] = set()
    for dist in GRADE_TOOLS:
        wanted.add(dist)
        try:
            requirements = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requirements:
            name = re.match(r"[A-Za-z0-9._-]+", requirement)
            if name and "extra ==" not in requirement:
                wanted.add(name.group().lower())
    names = set(sys.stdlib_module_names) | {name.removesuffix(".py") for name in PYTHON_STARTUP_NAMES}
    for top, owners in importlib.metadata.packages_distributions().items():
        if any(owner.lower() in wanted for owner in owners):
            names.add(top)
    return frozenset(names)


def unshadow_tools(copy: Path, problem: Problem) -> list[str]:
    """Removes, from the copy's root, the modules and packages the agent added under the name of a
    module the grade command's interpreter imports (``tool_modules``: ``re.py``, ``pytest.py``,
    ``pluggy/``): a grade command that puts the workspace on the module path (``PYTHONPATH=.``,
    ``-o pythonpath=.``) would import them in the tool's place. Template files stay (they are the
    code under test)."""
    suffixes = sorted(importlib.machinery.all_suffixes(), key=len, reverse=True)
    template_tops = {rel.split("/", 1)[0] for rel in problem.files} | set(problem.hidden_tests)
    actions = []
    for name in sorted(os.listdir(copy)):
        if name in template_tops:
            continue
        path = copy / name
        stem = name if path.is_dir() and not path.is_symlink() else None
        if stem is None:
            stem = next((name[: -len(s)] for s in suffixes if name.endswith(s)), None)
        if stem in tool_modules():
            remove_tree(path)
            actions.append(f"removed {name} (it shadows the module {stem} a grade command imports)")
    return actions


def place_hidden_file(root: Path, rel: str, text: str) -> None:
    """Writes a hidden file; whatever the agent left on its path (a link out, a folder) gives way."""
    _clear_path(root, rel)
    write_text(root, rel, text)
