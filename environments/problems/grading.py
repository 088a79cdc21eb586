"""Grading: a workspace in, a reward out, decided where no code the agent wrote can reach.

Every grade starts from a *grading copy* (environments/problems/grading_copy.py): a fresh folder
holding only what the agent may change (``Problem.editable``; by default everything but the hidden
test paths, dot-files, packaging metadata and byte code), the template's version of every other
template file, and the hidden files written over it. FIFOs, devices and sockets are skipped, and
the copy reads a bounded number of bytes however many hard links the workspace holds. Then one of
three graders (environments/problems/problem.py) runs in environments/sandbox.py (no network, the
checkout and other workspaces invisible, CPU, memory, process and wall-clock limits):

- **checks** (the generated suites, and folder problems with a ``checks.py``): each ``Check``'s
  probe runs in its own sandboxed command, ``<this interpreter> -I -B -`` (isolated: no user site,
  no PYTHON* variables, neither the workspace nor any script folder on the module path unless the
  check imports the agent's code); the probe reports values with ``observe``, and this process,
  which imports nothing from the workspace, compares them as JSON with the expected values that
  never entered the sandbox. A probe that crashes, hangs, exits early or prints anything else
  loses its check; it cannot fail the grader. The reward is passed / total.
- **the built-in pytest grader** (``Problem.grader == "pytest"``, folder problems with tests/ and
  no grade command): environments/problems/pytest_grader.py runs pytest over the hidden test
  modules from a runner outside the workspace and counts, here, only the hidden tests (an AST count
  fixed before any agent code runs) from a report that carries a nonce only the runner knows.
- **a grade command** (``grade.sh`` / ``grade = "..."``, the escape hatch): a bash script run in
  the copy after it is *neutralised* (``neutralise``: pytest configuration, conftest.py and
  start-up hooks that the agent wrote are removed, ones it changed restored), with
  ``PYTHONSAFEPATH=1`` (the working folder is not put first on the module path),
  ``PYTHONNOUSERSITE=1``, ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` and ``GYRE_REPORT`` (a path outside
  the copy) exported. ``grade_output`` says how it reports: ``json`` (last stdout line
  ``{"passed": k, "total": n}``), ``exit_code`` (0 is 1/1, anything else 0/1) or ``junit`` (JUnit
  XML written to ``$GYRE_REPORT``, counted per hidden test as the built-in grader counts; a missing
  report is reward 0).

The pytest-based graders and grade commands run the agent's code in the interpreter whose result
they read; docs/security.md says what that leaves open. The agent's workspace is never modified.
``GraderError`` means the grader itself failed (it could not start, or a command grader printed no
summary): the dispatcher retries it, then marks the execution ``eval_failed``. A grade that runs out
of time is never an error: the agent's code can hang it, so unreported tests fail (pytest graders)
and a grade command scores 0.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from environments.problems import pytest_grader
from environments.problems.grading_copy import grading_copy
from environments.problems.problem import Check, Problem, tail, write_text
from environments.sandbox import CommandResult, Sandbox, SandboxLimits, SandboxSetupError

CHECK_WALL_S = 5.0
"""Wall clock of one hidden check's probe (its interpreter start included)."""
_READY = "@@gyre-probe-ready@@"
_MARK = "@@gyre-observed@@ "
_PROBE_PRELUDE = f"""
import json as _json, os as _os, sys as _sys
from pathlib import Path
_OUT = _os.dup(1)
_os.write(_OUT, b"\\n{_READY}\\n")


def observe(value):
    try:
        text = _json.dumps(value, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        text = _json.dumps("<not JSON>")
    _os.write(_OUT, ("\\n{_MARK}" + text + "\\n").encode())


def lines_of(path):
    out = [line.rstrip() for line in Path(path).read_text().splitlines()]
    while out and not out[-1]:
        out.pop()
    return out
"""
NEUTRALISED_NAMES = frozenset(
    {"conftest.py", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg"}
    | {"sitecustomize.py", "usercustomize.py"}
)
"""Files that configure pytest or Python's start-up: in a command grader's copy, any of these the
agent wrote is removed and any it changed is restored from the template (see ``neutralise``)."""


class GraderError(RuntimeError):
    """The grader itself failed (could not start, or printed no summary): the execution is not graded."""


@dataclass
class GradeResult:
    """What grading one workspace gave."""

    reward: float
    """passed / total, in [0, 1]"""
    passed: int
    total: int
    log: str
    """per-check verdicts (checks) or the tail of the grader's stdout and stderr (command)"""


def grading_limits(timeout_s: float) -> SandboxLimits:
    """Sandbox limits of one grade command: the grader's own timeout, room for a test suite's memory."""
    return SandboxLimits(cpu_s=max(1, math.ceil(timeout_s)), memory_bytes=4 << 30, command_wall_s=timeout_s)


def grade_workspace(
    problem: Problem, workspace: str | Path, *, timeout_s: float = 60.0, limits: SandboxLimits | None = None
) -> GradeResult:
    """Grades a fresh copy of ``workspace`` with the problem's grader (see the module docstring).

    ``timeout_s`` bounds the whole grade; ``limits`` overrides ``grading_limits``. Raises GraderError
    when the grader itself fails; a failed check or test is a lower reward, never an error.
    """
    source = Path(workspace)
    if not source.is_dir():
        raise GraderError(f"problem {problem.problem_id}: workspace {source} is not a directory")
    with tempfile.TemporaryDirectory(prefix="gyre-grade-") as tmp:
        # box/ is what a command sees: the copy, and beside it (never inside) the grader's own files
        box = Path(tmp) / "box"
        copy = box / "workspace"
        notes = grading_copy(problem, source, copy)
        for rel, text in problem.hidden_tests.items():
            place_hidden_file(copy, rel, text)
        limits = limits or grading_limits(timeout_s)
        try:
            if problem.checks:
                result = _grade_checks(problem, Sandbox(copy, limits, hide_root=tmp), timeout_s)
            else:
                notes += neutralise(copy, problem.files) + unshadow_hidden_modules(copy, problem)
                sandbox = Sandbox(box, limits, hide_root=tmp)
                if problem.grader == "pytest":
                    result = _grade_pytest(problem, sandbox, copy, timeout_s)
                else:
                    result = _grade_command(problem, sandbox, copy, timeout_s)
        except SandboxSetupError as exc:
            raise GraderError(
                f"problem {problem.problem_id}: the grading sandbox could not start: {exc}"
            ) from None
    if notes:
        result.log = tail("[grading copy] " + "; ".join(notes) + "\n" + result.log)
    return result


# ------------------------------------------------------------------------------------ checks


def probe_source(check: Check) -> str:
    """The program one check's probe runs (fed to ``python -I -B -`` on stdin)."""
    path = "_sys.path.insert(0, _os.getcwd())\n" if check.imports_workspace else ""
    return f"{_PROBE_PRELUDE}\n{path}{check.probe}\n"


def observations(stdout: str) -> tuple[bool, list[object]]:
    """(whether the probe started, the values it observed in order); unparseable values count as
    a value no check expects."""
    lines = [line.rstrip("\r") for line in stdout.split("\n")]
    if _READY not in lines:
        return False, []
    seen: list[object] = []
    for line in lines[lines.index(_READY) + 1 :]:
        if line.startswith(_MARK):
            try:
                seen.append(json.loads(line[len(_MARK) :]))
            except json.JSONDecodeError:
                seen.append({"unparseable": line[len(_MARK) : len(_MARK) + 200]})
    return True, seen


def _canonical(values: list[object]) -> str:
    return json.dumps(values, sort_keys=True)


def _grade_checks(problem: Problem, sandbox: Sandbox, timeout_s: float) -> GradeResult:
    # the interpreter by absolute path, never a `python` found on a PATH the workspace could shadow
    command = f"exec {_shell_quote(sys.executable)} -I -B -"
    deadline_s, passed, report = timeout_s, 0, []
    for check in problem.checks:
        wall = min(CHECK_WALL_S, deadline_s)
        if wall <= 0:
            report.append(f"FAIL {check.name} - not run: the grade's {timeout_s:g} s were used up")
            continue
        result = sandbox.run(command, timeout_s=wall, stdin=probe_source(check))
        deadline_s -= result.wall_s
        started, seen = observations(result.stdout)
        if not started and not result.timed_out:
            raise GraderError(
                f"problem {problem.problem_id}: the probe of check {check.name!r} never started "
                f"(exit code {result.returncode}): {tail(result.stderr)}"
            )
        if started and _canonical(seen) == _canonical(check.expected):
            passed += 1
            report.append(f"PASS {check.name}")
        else:
            why = "timed out" if result.timed_out else f"observed {_canonical(seen)[:300]}"
            err = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []
            report.append(f"FAIL {check.name} - {why}{' - ' + err[0][:300] if err else ''}")
    total = len(problem.checks)
    return GradeResult(reward=passed / total, passed=passed, total=total, log=tail("\n".join(report)))


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# ------------------------------------------------------------------------------- a grade command


def neutralise(copy: Path, template: dict[str, str]) -> list[str]:
    """Removes from a grading copy what could change how its grader runs, and returns what it did.

    Files named in NEUTRALISED_NAMES (anywhere in the tree) that the template lacks are removed,
    ones the agent changed are restored to the template's text; ``__pycache__`` folders and ``.pyc``
    files are removed (byte code is compiled afresh from the sources the grader sees).
    """
    actions = []
    for dirpath, dirnames, filenames in os.walk(copy):
        for name in list(dirnames):
            if name == "__pycache__":
                shutil.rmtree(Path(dirpath, name), ignore_errors=True)
                dirnames.remove(name)
                actions.append(f"removed {Path(dirpath, name).relative_to(copy).as_posix()}/")
        for name in filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(copy).as_posix()
            if name.endswith(".pyc"):
                path.unlink()
                actions.append(f"removed {rel}")
            elif name in NEUTRALISED_NAMES:
                if rel in template and not path.is_symlink() and _read(path) == template[rel]:
                    continue
                path.unlink()
                if rel in template:
                    write_text(copy, rel, template[rel])
                    actions.append(f"restored {rel}")
                else:
                    actions.append(f"removed {rel}")
    return actions


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def unshadow_hidden_modules(copy: Path, problem: Problem) -> list[str]:
    """Removes workspace-root modules named like a hidden Python file (``test_calc.py`` beside a
    hidden ``tests/test_calc.py``): on the module path they would be imported in its place."""
    actions = []
    hidden_dirs = {PurePosixPath(rel).parent.as_posix() for rel in problem.hidden_tests}
    if "." in hidden_dirs:
        return actions
    for rel in problem.hidden_tests:
        stem = PurePosixPath(rel).stem
        if not rel.endswith(".py") or stem == "__init__":
            continue
        for shadow in (copy / f"{stem}.py", copy / stem):
            if shadow.is_symlink() or shadow.is_file():
                shadow.unlink()
            elif shadow.is_dir():
                shutil.rmtree(shadow)
            else:
                continue
            actions.append(f"removed {shadow.name} (it shadows the hidden {rel})")
    return actions


def _grade_pytest(problem: Problem, sandbox: Sandbox, copy: Path, timeout_s: float) -> GradeResult:
    """The built-in pytest grader (environments/problems/pytest_grader.py)."""
    expected = _hidden_test_ids(problem)
    nonce = secrets.token_hex(16)
    report = sandbox.workspace / "gyre-pytest-report.jsonl"
    runner = pytest_grader.runner_source(
        nonce=nonce,
        workspace=str(copy.resolve()),
        report=str(report),
        config=str(sandbox.workspace / "gyre-pytest.ini"),
        modules=pytest_grader.hidden_test_modules(problem.hidden_tests),
    )
    sandbox.env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    command = f"exec {_shell_quote(sys.executable)} -I -B -"
    result = sandbox.run(command, timeout_s=timeout_s, stdin=runner)
    started, outcomes, notes = pytest_grader.read_report(report, nonce)
    output = result.stdout + ("\n[stderr]\n" + result.stderr if result.stderr.strip() else "")
    if not started:  # nothing of the agent's runs before the start line: the grader is broken
        raise GraderError(
            f"problem {problem.problem_id}: the pytest runner never started "
            f"(exit code {result.returncode}, limit {result.limit}):\n{tail(output)}"
        )
    if result.timed_out:
        notes.append(f"timed out after {timeout_s:g} s: unreported tests fail")
    passed, lines = pytest_grader.score(expected, outcomes)
    log = tail("\n".join(notes + lines) + "\n" + output)
    return GradeResult(reward=passed / len(expected), passed=passed, total=len(expected), log=log)


def _hidden_test_ids(problem: Problem) -> list[str]:
    try:
        expected = pytest_grader.hidden_test_ids(problem.hidden_tests)
    except SyntaxError as exc:
        raise GraderError(
            f"problem {problem.problem_id}: a hidden test module does not parse: {exc}"
        ) from None
    if not expected:
        raise GraderError(f"problem {problem.problem_id}: the hidden test modules define no test")
    return expected


def _grade_command(problem: Problem, sandbox: Sandbox, copy: Path, timeout_s: float) -> GradeResult:
    report = sandbox.workspace / "gyre-report"
    sandbox.env["GYRE_REPORT"] = str(report)
    command = f"cd {_shell_quote(str(copy))} || exit 97\n{problem.grade_command or ''}"
    result = run_grade_command(command, sandbox, timeout_s)
    log = tail(result.stdout + ("\n[stderr]\n" + result.stderr if result.stderr.strip() else ""))
    if problem.grade_output == "junit":
        expected = _hidden_test_ids(problem)
        outcomes, notes = pytest_grader.junit_outcomes(report, expected)
        if result.timed_out:
            notes.append(f"timed out after {timeout_s:g} s: unreported tests fail")
        passed, lines = pytest_grader.score(expected, outcomes)
        log = tail("\n".join(notes + lines) + "\n" + log)
        return GradeResult(reward=passed / len(expected), passed=passed, total=len(expected), log=log)
    if result.timed_out:
        # code the agent wrote can hang the grade: that must not escape its zero (an error is never
        # trained on); a grader too slow on its own is what `gyre suite check` catches
        log = tail(f"timed out after {timeout_s:g} s: scored 0\n{log}")
        return GradeResult(reward=0.0, passed=0, total=1, log=log)
    if problem.grade_output == "exit_code":
        passed = int(result.returncode == 0)
        return GradeResult(reward=float(passed), passed=passed, total=1, log=log)
    try:
        passed, total = parse_grade_output(result.stdout)
    except GraderError as exc:
        limit = f", stopped by its {result.limit} limit" if result.limit else ""
        raise GraderError(
            f"problem {problem.problem_id}: {exc} (exit code {result.returncode}{limit})\n{log}"
        ) from None
    return GradeResult(reward=passed / total, passed=passed, total=total, log=log)


def run_grade_command(command: str, sandbox: Sandbox, timeout_s: float) -> CommandResult:
    """Runs a grader (or visible test) command in the sandbox's workspace.

    ``python`` on PATH is the interpreter running gyrerl: where it is only called e.g. python3.11,
    a link named ``python`` is made in ``.gyre_bin`` of the sandbox's folder (whatever stood there
    is removed first). PYTHONSAFEPATH keeps the working folder off the front of the module path
    (``python -m pytest`` would run a ``pytest.py`` found there), PYTHONNOUSERSITE keeps user
    site-packages out and PYTEST_DISABLE_PLUGIN_AUTOLOAD stops pytest loading every installed
    ``pytest11`` entry point (a ``*.dist-info`` folder on the module path declares one).
    """
    if not (Path(sys.executable).parent / "python").exists():
        shim = sandbox.workspace / ".gyre_bin"
        if shim.is_symlink() or shim.is_file():
            shim.unlink()
        shutil.rmtree(shim, ignore_errors=True)
        shim.mkdir()
        (shim / "python").symlink_to(sys.executable)
        sandbox.env["PATH"] = f"{shim}{os.pathsep}{sandbox.env['PATH']}"
    sandbox.env["PYTHONIOENCODING"] = "utf-8"
    sandbox.env["PYTHONNOUSERSITE"] = "1"
    sandbox.env["PYTHONSAFEPATH"] = "1"
    sandbox.env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return sandbox.run(command, timeout_s=timeout_s)


def parse_grade_output(stdout: str) -> tuple[int, int]:
    """(passed, total) from the last non-empty stdout line, which must be ``{"passed": k, "total": n}``."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise GraderError('grader printed nothing; its last stdout line must be {"passed": k, "total": n}')
    last = lines[-1].strip()
    try:
        data = json.loads(last)
    except json.JSONDecodeError:
        raise GraderError(
            f'grader\'s last stdout line is not JSON {{"passed": k, "total": n}}: {last[:200]!r}'
        ) from None
    if not isinstance(data, dict):
        raise GraderError(
            f'grader\'s last stdout line must be a JSON object {{"passed", "total"}}: {last[:200]!r}'
        )
    passed, total = data.get("passed"), data.get("total")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (passed, total)):
        raise GraderError(f'grader output needs integer "passed" and "total": {last[:200]!r}')
    if total <= 0 or not 0 <= passed <= total:
        raise GraderError(f"grader output needs 0 <= passed <= total and total > 0: {last[:200]!r}")
    return passed, total


def place_hidden_file(root: Path, rel: str, text: str) -> None:
    """Writes a hidden file; whatever the agent left on its path (a link out, a folder) gives way."""
    current = root
    for part in PurePosixPath(rel).parts:
        current = current / part
        # a link could point out of the copy; a file where a folder belongs would block mkdir
        if current.is_symlink() or (current.is_file() and current != root / rel):
            current.unlink()
    if (root / rel).is_dir():
        shutil.rmtree(root / rel)
    write_text(root, rel, text)
