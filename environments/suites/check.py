"""``gyre suite check``: every problem of a suite is well formed, solvable and not already solved.

For each problem: it loads (a broken folder or manifest line is named with what is wrong); its
reference solution, when it has one, scores 1.0 (apply_solution, then grade_workspace); its untouched
workspace scores below 1.0; and its grader finishes within its time limit (``Problem.grade_timeout_s``
or the default). A grader that hangs is stopped by the grading sandbox's wall clock and reported as
"grader did not finish within N s"; a GraderError is reported with the problem's name, never raised.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from environments.problems import GraderError, Problem, apply_solution, grade_workspace, write_workspace
from environments.suites.sources import FiniteSuite, GeneratedSuite, open_suite
from environments.suites.spec import SuiteSpec

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
    """The reference solution scores 1.0, the untouched workspace less, each grade within its limit."""
    limit = problem.grade_timeout_s or timeout_s
    name = problem.problem_id
    notes = []
    with tempfile.TemporaryDirectory(prefix="gyre-suite-check-") as tmp:
        untouched = write_workspace(problem, Path(tmp) / "untouched")
        score, why = _grade(problem, untouched, limit)
        if why:
            return CheckLine(name, False, f"untouched workspace: {why}")
        if score >= 1.0:
            return CheckLine(name, False, "its untouched workspace already scores 1.0 (nothing to solve)")
        notes.append(f"untouched {score:.2f}")
        if problem.solution:
            solved = write_workspace(problem, Path(tmp) / "solved")
            try:
                apply_solution(problem, solved, timeout_s=limit)
            except (RuntimeError, ValueError, KeyError) as exc:
                return CheckLine(name, False, f"reference solution could not be applied: {_first(exc)}")
            score, why = _grade(problem, solved, limit)
            if why:
                return CheckLine(name, False, f"reference solution: {why}")
            if score < 1.0:
                return CheckLine(name, False, f"reference solution scores {score:.2f}, not 1.0")
            notes.append("reference 1.00")
        else:
            notes.append("no reference solution")
    return CheckLine(name, True, ", ".join(notes))


def _grade(problem: Problem, workspace: Path, limit: float) -> tuple[float, str | None]:
    """(reward, None), or (0, why the grade failed)."""
    started = time.monotonic()
    try:
        result = grade_workspace(problem, workspace, timeout_s=limit)
    except GraderError as exc:
        if time.monotonic() - started >= limit * 0.95:
            return 0.0, f"grader did not finish within {limit:g} s"
        return 0.0, f"grader failed: {_first(exc).removeprefix(f'problem {problem.problem_id}: ')}"
    if time.monotonic() - started > limit:
        return 0.0, f"grader did not finish within {limit:g} s"
    return result.reward, None


def _first(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
