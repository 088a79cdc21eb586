"""Loads user-provided problems from a folder, so real benchmarks (NL2RepoBench-, SWE-style) plug in.

Layout: every direct subfolder is one problem (names starting with ``.`` or ``_`` are skipped)::

    my-benchmark/
      fix-parser/
        instruction.md     what the agent reads (required, not empty)
        workspace/         the template the agent starts from, any text files (optional: empty)
        grade.sh           the grade command, run with bash in the grading copy of the workspace
        tests/             hidden files, copied into the grading copy under tests/ (optional)
        problem.toml       optional settings, see below

The grader is either ``grade.sh`` or ``grade = "..."`` in problem.toml (exactly one of them). It runs
with bash in a fresh, neutralised copy of the agent's workspace (environments/problems/grading.py:
pytest configuration, conftest.py and start-up hooks the agent wrote are removed, ones it changed
restored) with the hidden files added, and must print
``{"passed": k, "total": n}`` as its last stdout line, unless ``grade_output = "exit_code"``: then
exit status 0 is reward 1 and anything else reward 0 (handy for SWE-bench style all-or-nothing tests).

problem.toml keys (all optional): ``id`` (default: the folder name), ``difficulty`` (int, default 1),
``grade``, ``grade_output`` (``"json"`` or ``"exit_code"``), ``visible_test_command`` (what the
harness's run_tests runs), ``hidden_tests_into`` (where tests/ lands in the workspace, default
``"tests"``; ``"."`` puts its files at the workspace root).

``read_folder`` returns every valid problem plus one message per broken one (naming the folder and
what is wrong); ``load_folder`` returns the valid problems, logs a warning per broken one, and raises
ValueError only when nothing valid was found or ``strict=True``.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from environments.problems.problem import Problem, check_relative_path

logger = logging.getLogger(__name__)

TOML_KEYS = {"id", "difficulty", "grade", "grade_output", "visible_test_command", "hidden_tests_into"}


class ProblemFolderError(ValueError):
    """One problem folder is unusable; the message names the folder and what is wrong."""


@dataclass
class FolderLoad:
    """What ``read_folder`` found: the valid problems and one message per broken problem folder."""

    problems: list[Problem] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def read_folder(path: str | Path) -> FolderLoad:
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"problem folder {root} does not exist or is not a directory")
    result = FolderLoad()
    seen: dict[str, Path] = {}
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        try:
            problem = load_problem(sub)
            if problem.problem_id in seen:
                raise ProblemFolderError(
                    f"{sub}: problem id {problem.problem_id!r} is also used by {seen[problem.problem_id]}"
                )
        except ProblemFolderError as exc:
            result.errors.append(str(exc))
            continue
        seen[problem.problem_id] = sub
        result.problems.append(problem)
    return result


def load_folder(path: str | Path, *, strict: bool = False) -> list[Problem]:
    """The valid problems under ``path``; broken ones are logged (or raise, with ``strict``)."""
    result = read_folder(path)
    for error in result.errors:
        logger.warning("skipping problem: %s", error)
    if result.errors and (strict or not result.problems):
        raise ValueError(
            f"{len(result.errors)} broken problem folder(s) in {path}:\n" + "\n".join(result.errors)
        )
    if not result.problems:
        raise ValueError(f"no problem folders in {path} (expected subfolders with instruction.md)")
    return result.problems


def load_problem(folder: Path) -> Problem:
    """One problem folder as a Problem; ProblemFolderError names the folder and what is missing."""
    settings = _settings(folder)
    instruction_file = folder / "instruction.md"
    if not instruction_file.is_file():
        raise ProblemFolderError(f"{folder}: instruction.md is missing")
    instruction = _read_text(instruction_file, folder).strip()
    if not instruction:
        raise ProblemFolderError(f"{folder}: instruction.md is empty")

    files = _read_tree(folder / "workspace", folder) if (folder / "workspace").is_dir() else {}
    hidden: dict[str, str] = {}
    if (folder / "tests").is_dir():
        into = settings.get("hidden_tests_into", "tests")
        for rel, text in _read_tree(folder / "tests", folder).items():
            hidden[str(PurePosixPath(into, rel))] = text

    script, inline = folder / "grade.sh", settings.get("grade")
    if script.is_file() and inline is not None:
        raise ProblemFolderError(f"{folder}: both grade.sh and grade in problem.toml are set; keep one")
    if script.is_file():  # its text is the command: no grader file in the workspace the agent wrote
        command = _read_text(script, folder)
    elif inline is not None:
        command = inline
    else:
        raise ProblemFolderError(
            f'{folder}: no grade command (add grade.sh or grade = "..." in problem.toml)'
        )
    if settings.get("grade_output", "json") == "exit_code":
        command = (
            f"( {command}\n); status=$?; echo; "
            'if [ "$status" -eq 0 ]; then echo \'{"passed": 1, "total": 1}\'; '
            'else echo \'{"passed": 0, "total": 1}\'; fi'
        )
    try:
        return Problem(
            problem_id=f"folder-{settings.get('id', folder.name)}",
            suite="folder",
            instruction=instruction,
            files=files,
            hidden_tests=hidden,
            grade_command=command,
            visible_test_command=settings.get("visible_test_command"),
            solution=[],
            difficulty=settings.get("difficulty", 1),
            meta={"source": str(folder)},
        )
    except ValueError as exc:
        raise ProblemFolderError(f"{folder}: {exc}") from None


def _settings(folder: Path) -> dict[str, Any]:
    path = folder / "problem.toml"
    if not path.is_file():
        return {}
    try:
        settings = tomllib.loads(_read_text(path, folder))
    except tomllib.TOMLDecodeError as exc:
        raise ProblemFolderError(f"{folder}: problem.toml is not valid TOML: {exc}") from None
    unknown = sorted(set(settings) - TOML_KEYS)
    if unknown:
        raise ProblemFolderError(
            f"{folder}: problem.toml has unknown keys {unknown}; known: {sorted(TOML_KEYS)}"
        )
    for key in ("id", "grade", "visible_test_command", "hidden_tests_into"):
        if key in settings and not (isinstance(settings[key], str) and settings[key].strip()):
            raise ProblemFolderError(f"{folder}: problem.toml {key} must be a non-empty string")
    difficulty = settings.get("difficulty", 1)
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or difficulty < 1:
        raise ProblemFolderError(
            f"{folder}: problem.toml difficulty must be an integer >= 1, got {difficulty!r}"
        )
    if settings.get("grade_output", "json") not in ("json", "exit_code"):
        raise ProblemFolderError(f'{folder}: problem.toml grade_output must be "json" or "exit_code"')
    if "hidden_tests_into" in settings and settings["hidden_tests_into"] != ".":
        try:
            check_relative_path(settings["hidden_tests_into"], what="hidden_tests_into")
        except ValueError as exc:
            raise ProblemFolderError(f"{folder}: problem.toml {exc}") from None
    return settings


def _read_tree(top: Path, folder: Path) -> dict[str, str]:
    """Every file under ``top`` as relative POSIX path -> text."""
    files = {}
    for path in sorted(top.rglob("*")):
        if path.is_file():
            files[path.relative_to(top).as_posix()] = _read_text(path, folder)
    return files


def _read_text(path: Path, folder: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ProblemFolderError(
            f"{folder}: {path.relative_to(folder)} is not UTF-8 text; problems hold text files only"
        ) from None
