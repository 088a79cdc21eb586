"""The ``terminal`` suite (TerminalBench-like): bring the workspace to a target state.

Each problem is a list of file-system operations spelled out in the instruction, e.g.

    Do the following in the workspace:
    1. Create the file notes/todo.txt containing the line: apple river
    2. Rename logs/plan.log to backup/plan.log.
    3. In config/agenda.cfg, change the setting mode=green to mode=winter.

Operations: create a file, rename, delete, copy, append lines, make a folder of empty files, edit a
setting. The reference solution uses shell commands (``mv``, ``cp``, ``rm``, ``echo >>``) where a
shell is natural and write_file where content is written. The hidden grader checks the final state,
one check per operation, so the reward is the fraction of operations done. Knobs: ``difficulty`` =
operations and distracting files; ``length`` = lines per written or appended file.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from environments.problems.checks import suite_problem
from environments.problems.problem import Problem
from environments.problems.registry import (
    WORDS,
    action,
    noise_files,
    problem_id,
    register_suite,
    words,
)

DIRS = ("notes", "logs", "data", "docs", "reports", "backup", "config", "inbox")
NEW_DIRS = ("projects", "images", "music", "photos", "exports", "outbox")
NAMES = ("todo", "plan", "ideas", "report", "summary", "list", "draft", "journal", "agenda", "memo")
EXTS = (".txt", ".md", ".log")
SETTINGS = ("mode", "level", "color", "size", "speed", "owner", "region", "theme")


@dataclass
class Operation:
    """One required change: its sentence, the files it needs in the template, its check and steps."""

    sentence: str
    check: str
    steps: list[dict[str, Any]]
    template: dict[str, str] = field(default_factory=dict)


class _Paths:
    """Hands out file paths that no other part of the problem uses."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.taken: set[str] = set()

    def file(self, *, folder: str | None = None, ext: str | None = None) -> str:
        for attempt in range(1000):
            where = folder if folder is not None else self.rng.choice(("", *DIRS))
            # numbered names once the plain ones run out (very high difficulty or length)
            name = (
                self.rng.choice(NAMES)
                + (str(attempt) if attempt > 20 else "")
                + (ext or self.rng.choice(EXTS))
            )
            path = f"{where}/{name}" if where else name
            if path not in self.taken:
                self.taken.add(path)
                return path
        raise RuntimeError("ran out of file names")  # unreachable: numbered names never collide for long

    def new_dir(self) -> str:
        for attempt in range(1000):
            path = self.rng.choice(NEW_DIRS) + (str(attempt) if attempt > 20 else "")
            if path not in self.taken:
                self.taken.add(path)
                return path
        raise RuntimeError("ran out of folder names")


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _content_lines(rng: random.Random, count: int) -> list[str]:
    return [words(rng, rng.randint(2, 3)) for _ in range(count)]


def _listed(lines: list[str]) -> str:
    """Lines shown under an instruction item, indented so they read as a block."""
    return "".join(f"\n    {line}" for line in lines)


def _mkdir_then(path: str, command: str) -> str:
    folder = path.rpartition("/")[0]
    return f"mkdir -p {folder} && {command}" if folder else command


def _create(rng: random.Random, paths: _Paths, length: int) -> Operation:
    path, lines = paths.file(), _content_lines(rng, length)
    if length == 1:
        sentence = f"Create the file {path} containing the line: {lines[0]}"
    else:
        sentence = f"Create the file {path} containing these lines:{_listed(lines)}"
    check = f"expect_equal(lines_of({path!r}), {lines!r}, {path!r})"
    return Operation(sentence, check, [action("write_file", path=path, content=_text(lines))])


def _rename(rng: random.Random, paths: _Paths, length: int) -> Operation:
    return _relocate(rng, paths, length, "mv")


def _copy(rng: random.Random, paths: _Paths, length: int) -> Operation:
    return _relocate(rng, paths, length, "cp")


def _relocate(rng: random.Random, paths: _Paths, length: int, command: str) -> Operation:
    """A file moved (``mv``: the source must be gone) or copied (``cp``: the source must stay) to
    another folder."""
    source, lines = paths.file(), _content_lines(rng, length)
    target = paths.file(folder=rng.choice(DIRS))
    if command == "mv":
        verb, check = "Rename", f"expect(not Path({source!r}).exists(), '{source} still exists')\n"
    else:
        verb, check = "Copy", f"expect_equal(lines_of({source!r}), {lines!r}, {source!r})\n"
    check += f"expect_equal(lines_of({target!r}), {lines!r}, {target!r})"
    steps = [action("run", command=_mkdir_then(target, f"{command} {source} {target}"))]
    return Operation(f"{verb} {source} to {target}.", check, steps, {source: _text(lines)})


def _delete(rng: random.Random, paths: _Paths, length: int) -> Operation:
    path = paths.file()
    check = f"expect(not Path({path!r}).exists(), '{path} still exists')"
    steps = [action("run", command=f"rm {path}")]
    return Operation(f"Delete the file {path}.", check, steps, {path: _text(_content_lines(rng, length))})


def _append(rng: random.Random, paths: _Paths, length: int) -> Operation:
    path = paths.file()
    old, new = _content_lines(rng, rng.randint(1, 3)), _content_lines(rng, length)
    if length == 1:
        sentence = f"Append to the end of {path} the line: {new[0]}"
    else:
        sentence = f"Append to the end of {path} these lines:{_listed(new)}"
    check = f"expect_equal(lines_of({path!r}), {old + new!r}, {path!r})"
    command = " && ".join(f"echo '{line}' >> {path}" for line in new)
    return Operation(sentence, check, [action("run", command=command)], {path: _text(old)})


def _folder(rng: random.Random, paths: _Paths, length: int) -> Operation:
    folder = paths.new_dir()
    names = sorted({paths.file(folder=folder).rpartition("/")[2] for _ in range(length + 1)})
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    empty = "the empty file" if len(names) == 1 else "the empty files"
    check = "\n".join(
        f"expect(Path({f'{folder}/{n}'!r}).is_file(), '{folder}/{n} is missing')" for n in names
    )
    command = f"mkdir -p {folder} && touch " + " ".join(f"{folder}/{n}" for n in names)
    return Operation(
        f"Create the folder {folder} containing {empty} {listed}.", check, [action("run", command=command)]
    )


def _edit_setting(rng: random.Random, paths: _Paths, length: int) -> Operation:
    path = paths.file(folder="config", ext=".cfg")
    keys = rng.sample(SETTINGS, min(len(SETTINGS), length + 1))
    lines = [f"{key}={rng.choice(WORDS)}" for key in keys]
    index = rng.randrange(len(lines))
    key, old = lines[index].split("=")
    new = rng.choice([w for w in WORDS if w != old])
    edited = [*lines[:index], f"{key}={new}", *lines[index + 1 :]]
    check = f"expect_equal(lines_of({path!r}), {edited!r}, {path!r})"
    steps = [action("read_file", path=path), action("write_file", path=path, content=_text(edited))]
    sentence = f"In {path}, change the setting {key}={old} to {key}={new}."
    return Operation(sentence, check, steps, {path: _text(lines)})


OPERATIONS: dict[str, Callable[[random.Random, _Paths, int], Operation]] = {
    "create": _create,
    "rename": _rename,
    "delete": _delete,
    "copy": _copy,
    "append": _append,
    "folder": _folder,
    "edit": _edit_setting,
}


@register_suite("terminal")
def generate_terminal(n: int, *, seed: int, difficulty: int, length: int) -> list[Problem]:
    return [_one(seed, difficulty, length, index) for index in range(n)]


def _one(seed: int, difficulty: int, length: int, index: int) -> Problem:
    rng = random.Random(problem_id("terminal", seed, difficulty, length, index))
    kinds = list(OPERATIONS)
    chosen = rng.sample(kinds, difficulty) if difficulty <= len(kinds) else rng.choices(kinds, k=difficulty)
    paths = _Paths(rng)
    operations = [OPERATIONS[kind](rng, paths, length) for kind in chosen]

    if len(operations) == 1:
        instruction = operations[0].sentence
    else:
        items = "\n".join(f"{i}. {op.sentence}" for i, op in enumerate(operations, 1))
        instruction = f"Do the following in the workspace:\n{items}"
    files: dict[str, str] = {}
    for op in operations:
        files |= op.template
    files |= noise_files(rng, difficulty - 1, set(paths.taken))
    checks = [(f"step {i}: {op.sentence.splitlines()[0]}", op.check) for i, op in enumerate(operations, 1)]
    solution = [step for op in operations for step in op.steps]
    solution.append(
        action("finish", summary=f"Done: {len(operations)} change{'s' if len(operations) > 1 else ''}.")
    )
    meta = {"items": len(operations), "operations": chosen}
    knobs = (seed, difficulty, length, index)
    return suite_problem("terminal", knobs, instruction, files, checks, solution, None, meta)
