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
  fixed before any agent code runs) from a report the runner writes to a file outside every folder
  the sandbox shows, through a descriptor no process the tests start inherits.
- **a grade command** (``grade.sh`` / ``grade = "..."``, the escape hatch): a bash script run in
  the copy after it is *neutralised* (grading_copy.py ``neutralise``: pytest configuration,
  conftest.py, start-up hooks and package markers on the way to the hidden tests that the agent wrote
  are removed, ones it changed restored; modules that would shadow a hidden one removed), with
  ``PYTHONSAFEPATH=1`` (the working folder is not put first on the module path),
  ``PYTHONNOUSERSITE=1``, ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` and ``GYRE_REPORT`` (a path outside
  the copy) exported. ``grade_output`` says how it reports: ``json`` (last stdout line
  ``{"passed": k, "total": n}``), ``exit_code`` (0 is 1/1, anything else 0/1) or ``junit`` (JUnit
  XML written to ``$GYRE_REPORT``, counted per hidden test as the built-in grader counts). A missing
  report or summary is reward 0.

The pytest-based graders and grade commands run the agent's code in the interpreter whose result
they read; docs/security.md says what that leaves open. The agent's workspace is never modified.

**A grade is total.** Whatever an agent leaves (links, loops, depth, names, sizes, special files) and
whatever its code does while graded (deleting files, hanging, crashing the test process, filling the
grading folder, which is a size-limited tmpfs where the kernel allows one) gives a reward in [0, 1]:
what cannot be graded scores 0, with the reason in ``GradeResult.ungraded`` and the log.
``GraderError`` is left for a grader that is broken whatever the workspace holds (its sandbox or its
runner could not start, a hidden test module does not parse): the dispatcher retries it, then marks
the execution ``eval_failed``. A grade that runs out of time is never an error: unreported tests fail
(pytest graders) and a grade command scores 0.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from environments.problems import pytest_grader
from environments.problems.grading_copy import (
    GRADE_COPY_BYTES,
    GRADE_COPY_ENTRIES,
    grading_copy,
    neutralise,
    place_hidden_file,
    unshadow_hidden_modules,
    unshadow_tools,
)
from environments.problems.problem import Check, Problem, tail
from environments.sandbox import CommandResult, Sandbox, SandboxLimits, SandboxSetupError
from environments.sandbox_host import mount_quota, unmount
from environments.workspace_tree import remove_tree

logger = logging.getLogger(__name__)

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
GRADE_BOX_BYTES = GRADE_COPY_BYTES + (256 << 20)
"""Size of the tmpfs a grade runs in: the copy, and what the grader and the agent's code write."""
GRADE_BOX_FILES = GRADE_COPY_ENTRIES + 10_000


class GraderError(RuntimeError):
    """The grader is broken whatever the workspace holds (its sandbox or runner could not start, a
    hidden test does not parse): retried, then the execution is ``eval_failed``, never trained on."""


@dataclass
class GradeResult:
    """What grading one workspace gave."""

    reward: float
    """passed / total, in [0, 1]"""
    passed: int
    total: int
    log: str
    """per-check verdicts (checks) or the tail of the grader's stdout and stderr (command)"""
    ungraded: str | None = None
    """Why the workspace could not be graded and scored 0 (None: it was graded)."""


def grading_limits(timeout_s: float) -> SandboxLimits:
    """Sandbox limits of one grade command: the grader's own timeout, room for a test suite's memory."""
    return SandboxLimits(cpu_s=max(1, math.ceil(timeout_s)), memory_bytes=4 << 30, command_wall_s=timeout_s)


def grade_workspace(
    problem: Problem, workspace: str | Path, *, timeout_s: float = 60.0, limits: SandboxLimits | None = None
) -> GradeResult:
    """Grades a fresh copy of ``workspace`` with the problem's grader (see the module docstring).

    ``timeout_s`` bounds the whole grade; ``limits`` overrides ``grading_limits``. Raises GraderError
    only when the grader itself is broken; whatever the workspace holds gives a reward in [0, 1].
    """
    source = Path(workspace)
    if not source.is_dir():
        raise GraderError(f"problem {problem.problem_id}: workspace {source} is not a directory")
    tmp = Path(tempfile.mkdtemp(prefix="gyre-grade-"))
    # box/ is what a command sees: the copy, and beside it (never inside) the grader's own files;
    # the grader's report lives in tmp, which no command sees
    box = tmp / "box"
    box.mkdir()
    quota = mount_quota(box, GRADE_BOX_BYTES, GRADE_BOX_FILES, warn=False)
    if not quota:
        _box_has_no_quota()
    try:
        result = _grade_in(problem, source, tmp, box, timeout_s, limits or grading_limits(timeout_s))
    finally:
        try:  # the grade stands whatever its clean-up meets
            if quota:
                unmount(box)  # lazily: never busy
            remove_tree(tmp)  # the agent's code may have left a tree of any depth in box/
        except OSError:
            logger.exception("could not remove the grading folder %s", tmp)
    return result


@cache
def _box_has_no_quota() -> None:
    """Says once per process that grades run in plain folders (the kernel refused the tmpfs)."""
    logger.warning(
        "GRADING HAS NO DISK QUOTA: the kernel refused a tmpfs for the grading folder; what the agent's "
        "code writes while it is graded fills the host's /tmp"
    )


def _grade_in(
    problem: Problem, source: Path, tmp: Path, box: Path, timeout_s: float, limits: SandboxLimits
) -> GradeResult:
    copy = box / "workspace"
    try:
        notes = grading_copy(problem, source, copy)
        for rel, text in problem.hidden_tests.items():
            place_hidden_file(copy, rel, text)
        if not problem.checks:
            notes += neutralise(copy, problem) + unshadow_hidden_modules(copy, problem)
        if problem.grade_command:
            notes += unshadow_tools(copy, problem)
    except Exception as exc:  # a workspace no copy could take scores 0: never an error
        logger.exception("problem %s: the grading copy of %s failed", problem.problem_id, source)
        return ungraded(problem, f"the grading copy failed: {type(exc).__name__}: {exc}")
    try:
        if problem.checks:
            result = _grade_checks(problem, Sandbox(copy, limits, hide_root=tmp), timeout_s)
        elif problem.grader == "pytest":
            result = _grade_pytest(problem, Sandbox(box, limits, hide_root=tmp), copy, tmp, timeout_s)
        else:
            result = _grade_command(problem, Sandbox(box, limits, hide_root=tmp), copy, timeout_s)
    except SandboxSetupError as exc:
        raise GraderError(
            f"problem {problem.problem_id}: the grading sandbox could not start: {exc}"
        ) from None
    except GraderError:
        raise
    except Exception as exc:  # what the agent's code left behind must not escape its 0
        logger.exception("problem %s: grading %s failed", problem.problem_id, source)
        return ungraded(problem, f"grading failed: {type(exc).__name__}: {exc}")
    if notes:
        result.log = tail("[grading copy] " + "; ".join(notes) + "\n" + result.log)
    return result


def ungraded(problem: Problem, why: str) -> GradeResult:
    """Reward 0 for a workspace that could not be graded, saying why."""
    total = len(problem.checks) or len(_safe_test_ids(problem)) or 1
    return GradeResult(reward=0.0, passed=0, total=total, log=f"ungraded, scored 0: {why}", ungraded=why)


def _safe_test_ids(problem: Problem) -> list[str]:
    try:
        return pytest_grader.hidden_test_ids(problem.hidden_tests)
    except SyntaxError:
        return []


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


def _grade_pytest(problem: Problem, sandbox: Sandbox, copy: Path, tmp: Path, timeout_s: float) -> GradeResult:
    """The built-in pytest grader (environments/problems/pytest_grader.py): its report is a file in
    ``tmp`` (which no sandboxed command sees) that the runner reaches only through the descriptor it
    inherits and closes on exec."""
    expected = _hidden_test_ids(problem)
    nonce = secrets.token_hex(16)
    report = tmp / "pytest-report.jsonl"
    fd = os.open(report, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        runner = pytest_grader.runner_source(
            nonce=nonce,
            workspace=str(copy.resolve()),
            report_fd=fd,
            config=str(sandbox.workspace / "gyre-pytest.ini"),
            modules=pytest_grader.hidden_test_modules(problem.hidden_tests),
        )
        sandbox.env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        command = f"exec {_shell_quote(sys.executable)} -I -B -"
        result = sandbox.run(command, timeout_s=timeout_s, stdin=runner, pass_fds=(fd,))
    finally:
        os.close(fd)
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
        # the agent's code runs in this command and can stop it before its summary: that scores 0
        # (`gyre suite check` finds a grade script that prints no summary on its own)
        limit = f", stopped by its {result.limit} limit" if result.limit else ""
        why = f"{exc} (exit code {result.returncode}{limit})"
        return GradeResult(reward=0.0, passed=0, total=1, log=tail(f"scored 0: {why}\n{log}"), ungraded=why)
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
        remove_tree(shim)
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
