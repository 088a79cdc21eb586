"""``gyre suite check``: every problem of a suite is well formed, solvable and not already solved.

For each problem: it loads (a broken folder or manifest line is named with what is wrong); its
reference solution, when it has one, scores 1.0 (apply_solution, then grade_workspace); its untouched
workspace scores below 1.0; and its grader finishes within its time limit (``Problem.grade_timeout_s``
or the default). A grader that hangs is stopped by the grading sandbox's wall clock and reported as
"grader did not finish within N s"; a GraderError is reported with the problem's name, never raised.
"""

from __future__ import annotations

import ast
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from environments.problems import (
    GraderError,
    GradeResult,
    Problem,
    SolutionError,
    apply_solution,
    grade_workspace,
    write_workspace,
)
from environments.suites.sources import FiniteSuite, GeneratedSuite, open_suite
from environments.suites.spec import SuiteSpec
from environments.suites.split import source_id

DEFAULT_GRADE_TIMEOUT_S = 60.0
GENERATED_SAMPLE = 8
"""How many problems of a generated suite are checked (generator seed 0)."""


@dataclass
class CheckLine:
    """The verdict on one problem (or on a line that is no problem)."""

    name: str
    ok: bool
    message: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.message}"


def check_suite(spec: SuiteSpec, *, timeout_s: float = DEFAULT_GRADE_TIMEOUT_S) -> Iterator[CheckLine]:
    """One CheckLine per problem of the suite (and per broken entry), as each is checked."""
    opened = open_suite(spec)
    if isinstance(opened, GeneratedSuite):
        problems = opened.generate(GENERATED_SAMPLE, seed=0, difficulty=1, length=1)
        opened = FiniteSuite(problems, [])
    for error in opened.errors:
        name, _, what = error.partition(": ")
        yield CheckLine(name, False, f"malformed: {what or error}")
    for problem in opened.problems:
        yield check_problem(problem, timeout_s=timeout_s)


def check_problem(problem: Problem, *, timeout_s: float = DEFAULT_GRADE_TIMEOUT_S) -> CheckLine:
    """The reference solution scores 1.0, the untouched workspace less, each grade within its limit.
    The line names the problem by its source id (``source_id``: what ``held_out`` takes)."""
    limit = problem.grade_timeout_s or timeout_s
    name = source_id(problem)
    notes = []
    with tempfile.TemporaryDirectory(prefix="gyre-suite-check-") as tmp:
        untouched = write_workspace(problem, Path(tmp) / "untouched")
        result, why = _grade(problem, untouched, limit)
        if why:
            return CheckLine(name, False, f"untouched workspace: {why}")
        if result.reward >= 1.0:
            return CheckLine(name, False, "its untouched workspace already scores 1.0 (nothing to solve)")
        notes.append(f"untouched {result.reward:.2f}")
        if problem.solution:
            solved = write_workspace(problem, Path(tmp) / "solved")
            try:
                apply_solution(problem, solved, timeout_s=limit)
            except SolutionError as exc:
                what = "timed out" if exc.returncode is None else f"exited with {exc.returncode}"
                script = "solution.sh" if "source" in problem.meta else "its command"  # a folder's
                return CheckLine(
                    name, False, f"reference solution: {script} {what}\n{_indent(exc.output_tail())}"
                )
            except (RuntimeError, ValueError, KeyError) as exc:
                return CheckLine(name, False, f"reference solution could not be applied: {_first(exc)}")
            result, why = _grade(problem, solved, limit)
            if why:
                return CheckLine(name, False, f"reference solution: {why}")
            if result.reward < 1.0:
                return CheckLine(
                    name,
                    False,
                    f"reference solution scores {result.reward:.2f}, not 1.0\n{_indent(_failed(result))}",
                )
            notes.append("reference 1.00")
        else:
            notes.append("no reference solution")
    message = ", ".join(notes)
    if weakness := grader_weakness(problem):
        message += f"\n     note: {weakness} (docs/security.md)"
    return CheckLine(name, True, message)


def grader_weakness(problem: Problem) -> str | None:
    """What an agent's code could do to this problem's grader without solving it, when the grader
    is one of those docs/security.md names limits for; None for checks.py and for hidden tests that
    import nothing of the workspace's."""
    if problem.grade_command:
        return "a grade command reads output the agent's code can write; checks.py or hidden tests hold more"
    tops = {PurePosixPath(rel).parts[0].removesuffix(".py") for rel in problem.files}
    for rel, text in problem.hidden_tests.items():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(name.split(".")[0] in tops for name in names):
                return f"{rel} imports the agent's code, which can patch pytest from there; a test that runs it as a subprocess holds"
    return None


def _grade(problem: Problem, workspace: Path, limit: float) -> tuple[GradeResult, str | None]:
    """(the grade, None), or (a zero grade, why the grade failed)."""
    started = time.monotonic()
    try:
        result = grade_workspace(problem, workspace, timeout_s=limit)
    except GraderError as exc:
        if time.monotonic() - started >= limit * 0.95:
            return _ZERO, f"grader did not finish within {limit:g} s"
        return _ZERO, f"grader failed: {_first(exc).removeprefix(f'problem {problem.problem_id}: ')}"
    if time.monotonic() - started > limit:
        return _ZERO, f"grader did not finish within {limit:g} s"
    if result.ungraded:  # scored 0 because the grader gave no verdict (a command that printed no summary)
        return _ZERO, f"grader failed: {result.ungraded}"
    return result, None


_ZERO = GradeResult(reward=0.0, passed=0, total=0, log="")


def _failed(result: GradeResult, lines: int = 8) -> str:
    """The tests or checks that failed, from the grader's PASS/FAIL lines; without any (a grade
    command that prints none), the end of what the grader printed."""
    failed = [line for line in result.log.splitlines() if line.startswith("FAIL ")]
    if failed:
        more = [f"... and {len(failed) - lines} more"] if len(failed) > lines else []
        return "\n".join(
            [f"{result.total - result.passed} of {result.total} failed:", *failed[:lines], *more]
        )
    kept = result.log.rstrip().splitlines()[-lines:]
    return "\n".join([f"{result.passed} of {result.total} passed; the grader printed:", *kept])


def _indent(text: str) -> str:
    return "\n".join(f"     {line}" for line in text.splitlines())


def _first(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
