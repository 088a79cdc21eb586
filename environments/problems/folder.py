"""Loads user-provided problems from a folder, so real benchmarks (NL2RepoBench-, SWE-style) plug in.

Layout: every direct subfolder is one problem (names starting with ``.`` or ``_`` are skipped)::

    my-benchmark/
      fix-parser/
        instruction.md     what the agent reads (required, not empty)
        workspace/         the template the agent starts from, any text files (optional: empty)
        tests/             hidden files, written over the grading copy under tests/ (optional)
        checks.py          hidden checks judged outside the sandbox (optional, see below)
        grade.sh           a grade command, the escape hatch (optional, see below)
        solution/          reference files overlaid on the workspace (optional)
        solution.sh        a reference script run with bash in the workspace, after solution/ (optional)
        problem.toml       optional settings, see below

The grader is one of (environments/problems/grading.py says what each guarantees, docs/security.md
how to choose):

- **the built-in pytest grader**, the default when ``tests/`` holds test modules and no other grader
  is given (or ``grader = "pytest"``): gyre runs pytest on the hidden test modules itself, from a
  runner outside the workspace, and the reward is the share of the hidden test functions that
  passed (pytest_grader.py: an AST count of ``test*`` functions and methods in ``test_*.py`` /
  ``*_test.py``, parametrized instances grouped per function; tests the agent adds never count).
- **checks.py**: hidden checks in the check language of the generated suites
  (environments/problems/checks.py), probed in the sandbox and judged in the grading process, so no
  agent code runs where the verdict is taken. The file holds imports (shared by every check) and
  ``def check_<name>():`` functions whose bodies are imports and ``expect_equal(got, want, what)``
  lines (``expect(condition, message)`` too when the check imports nothing)::

      import calc

      def check_add():
          expect_equal(calc.add(2, 3), 5, "add(2, 3)")

- **a grade command**: ``grade.sh`` or ``grade = "..."`` in problem.toml, run with bash in the
  grading copy (cwd) with ``PYTHONSAFEPATH=1`` (so ``python -m pytest`` no longer puts the workspace
  on the module path: use ``python -m pytest -o pythonpath=. tests``), plugin autoloading off and
  ``$GYRE_REPORT`` naming a file outside the copy. ``grade_output`` says how it reports: ``"json"``
  (default: last stdout line ``{"passed": k, "total": n}``), ``"exit_code"`` (status 0 is reward 1,
  else 0; SWE-bench style) or ``"junit"`` (JUnit XML written to ``$GYRE_REPORT``, e.g. pytest
  ``--junitxml=$GYRE_REPORT``, counted per hidden test like the built-in grader).

Every grader sees a *grading copy* of the workspace: only the paths the agent may change
(``editable``) are taken, the template's version of every other template file, then the hidden
files; pytest configuration and conftest.py files the agent wrote are removed (grading_copy.py).

problem.toml keys (all optional): ``id`` (default: the folder name), ``difficulty`` (int, default 1),
``grader`` (``"pytest"``), ``grade``, ``grade_output`` (``"json"``, ``"exit_code"`` or ``"junit"``),
``grade_timeout_s`` (seconds of one grade, default the dispatcher's), ``editable`` (list of glob
patterns of the paths the agent may change, e.g. ``["src/*"]``; default everything but the hidden
test paths, dot-files, packaging metadata and byte code), ``visible_test_command`` (what the
harness's run_tests runs), ``hidden_tests_into`` (where tests/ lands in the workspace, default
``"tests"``; ``"."`` puts its files at the workspace root).

``read_folder`` returns every valid problem plus one message per broken one (naming the folder and
what is wrong); ``load_folder`` returns the valid problems, logs a warning per broken one, and raises
ValueError only when nothing valid was found or ``strict=True``.
"""

from __future__ import annotations

import ast
import logging
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from environments.problems.checks import compile_check
from environments.problems.problem import GRADE_OUTPUTS, Check, Problem, check_relative_path
from environments.problems.pytest_grader import hidden_test_ids

logger = logging.getLogger(__name__)

TOML_KEYS = {
    "id",
    "difficulty",
    "grader",
    "grade",
    "grade_output",
    "grade_timeout_s",
    "editable",
    "visible_test_command",
    "hidden_tests_into",
}


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

    checks = _read_checks(folder) if (folder / "checks.py").is_file() else []
    command = _grade_command(folder, settings)
    grader = _grader(folder, settings, hidden, checks, command)
    try:
        return Problem(
            problem_id=f"folder-{settings.get('id', folder.name)}",
            suite="folder",
            instruction=instruction,
            files=files,
            checks=checks,
            hidden_tests=hidden,
            grade_command=command,
            grade_output=settings.get("grade_output", "json"),
            grader=grader,
            editable=settings.get("editable"),
            visible_test_command=settings.get("visible_test_command"),
            solution=_solution(folder),
            difficulty=settings.get("difficulty", 1),
            meta={"source": str(folder)},
            grade_timeout_s=settings.get("grade_timeout_s"),
        )
    except ValueError as exc:
        raise ProblemFolderError(f"{folder}: {exc}") from None


def _grade_command(folder: Path, settings: dict[str, Any]) -> str | None:
    script, inline = folder / "grade.sh", settings.get("grade")
    if script.is_file() and inline is not None:
        raise ProblemFolderError(f"{folder}: both grade.sh and grade in problem.toml are set; keep one")
    if script.is_file():  # its text is the command: no grader file in the workspace the agent wrote
        return _read_text(script, folder)
    return inline


def _grader(
    folder: Path, settings: dict[str, Any], hidden: dict[str, str], checks: list[Check], command: str | None
) -> str | None:
    """ "pytest" for the built-in pytest grader, None when checks.py or a grade command grades."""
    explicit = settings.get("grader")
    given = [name for name, there in (("checks.py", checks), ("a grade command", command)) if there]
    if explicit == "pytest" and given:
        raise ProblemFolderError(f'{folder}: grader = "pytest" and {given[0]} are both set; keep one')
    if len(given) > 1:
        raise ProblemFolderError(f"{folder}: both checks.py and a grade command are set; keep one")
    if "grade_output" in settings and command is None:
        raise ProblemFolderError(f"{folder}: problem.toml grade_output applies to a grade command only")
    needs_tests = explicit == "pytest" or not given or settings.get("grade_output") == "junit"
    if needs_tests:
        try:
            tests = hidden_test_ids(hidden)
        except SyntaxError as exc:
            raise ProblemFolderError(f"{folder}: a hidden test module does not parse: {exc}") from None
        if not tests:
            raise ProblemFolderError(
                f"{folder}: no grader: add tests/ with test_*.py files defining test functions, "
                'checks.py, grade.sh or grade = "..." in problem.toml'
            )
    return "pytest" if not given else None


def _read_checks(folder: Path) -> list[Check]:
    """checks.py as compiled checks: its imports go before every ``check_*`` function's body."""
    text = _read_text(folder / "checks.py", folder)
    try:
        tree = ast.parse(text, filename="checks.py")
    except SyntaxError as exc:
        raise ProblemFolderError(f"{folder}: checks.py does not parse: {exc}") from None
    imports, functions = [], []
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            imports.append(ast.unparse(node))
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("check_") and not node.args.args:
            functions.append(node)
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):  # docstrings
            raise ProblemFolderError(
                f"{folder}: checks.py line {node.lineno}: only imports and def check_<name>(): functions "
                f"may stand at the top level, got {ast.unparse(node).splitlines()[0]!r}"
            )
    if not functions:
        raise ProblemFolderError(f"{folder}: checks.py defines no def check_<name>(): function")
    checks = []
    for function in functions:
        body = [
            s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
        ]
        code = "\n".join([*imports, *(ast.unparse(s) for s in body)])
        try:
            checks.append(compile_check(function.name, code))
        except (ValueError, SyntaxError) as exc:
            raise ProblemFolderError(f"{folder}: checks.py {function.name}: {exc}") from None
    return checks


def _solution(folder: Path) -> list[dict[str, Any]]:
    """solution/ as write_file actions, then solution.sh as one run action."""
    actions: list[dict[str, Any]] = []
    if (folder / "solution").is_dir():
        for rel, text in _read_tree(folder / "solution", folder).items():
            actions.append({"tool": "write_file", "arguments": {"path": rel, "content": text}})
    if (folder / "solution.sh").is_file():
        actions.append({"tool": "run", "arguments": {"command": _read_text(folder / "solution.sh", folder)}})
    return actions


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
    if settings.get("grade_output", "json") not in GRADE_OUTPUTS:
        raise ProblemFolderError(f"{folder}: problem.toml grade_output must be one of {list(GRADE_OUTPUTS)}")
    if settings.get("grader", "pytest") != "pytest":
        raise ProblemFolderError(
            f'{folder}: problem.toml grader must be "pytest" (checks.py and grade commands are found '
            f"by their files), got {settings['grader']!r}"
        )
    timeout = settings.get("grade_timeout_s", 1)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ProblemFolderError(
            f"{folder}: problem.toml grade_timeout_s must be a number > 0, got {timeout!r}"
        )
    editable = settings.get("editable", [])
    if not isinstance(editable, list) or not all(isinstance(p, str) and p.strip() for p in editable):
        raise ProblemFolderError(
            f"{folder}: problem.toml editable must be a list of glob patterns (strings), got {editable!r}"
        )
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
