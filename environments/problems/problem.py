"""What a problem is: the instruction an agent reads, the workspace it starts in, and its grader.

A problem carries two kinds of secret that no execution may ever see: its grader (``checks`` for
the generated suites and folder checks.py files, ``hidden_tests`` run by the built-in pytest grader
or by a ``grade_command`` for user folders) and its reference ``solution``. Harnesses get ``Problem.public()``, which holds neither; environments/problems/
grading.py is the only reader of the grader.

    problem = generate("terminal", 1, seed=7)[0]
    write_workspace(problem, ws)          # the template the agent starts from
    apply_solution(problem, ws)           # the reference actions (demonstrations, tests)
    grade_workspace(problem, ws).reward   # 1.0
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Self

from environments.tools import TOOL_NAMES

LOG_TAIL_CHARS = 4000
GRADE_OUTPUTS = ("json", "exit_code", "junit")
"""How a grade command reports (Problem.grade_output)."""


@dataclass
class Check:
    """One hidden check, split so that the verdict never depends on code the agent wrote.

    ``probe`` runs in the sandbox, in a fresh isolated Python, and reports what it sees with
    ``observe(value)``; the grading process compares the observed values, as JSON, with
    ``expected``, which never enters the sandbox. Forging an observation therefore needs the
    expected values, which is solving the problem. Built by ``environments.problems.checks.compile_check``.
    """

    name: str
    probe: str
    """Python source; ``observe``, ``lines_of`` and ``Path`` are in scope."""
    expected: list[Any]
    """The JSON values the probe must observe, in order."""
    imports_workspace: bool = False
    """True: the workspace is on the probe's module path (it imports the agent's code), so only
    ``expect_equal`` checks are allowed (see compile_check)."""


class JsonFields:
    """``to_json`` / ``from_json`` of a dataclass whose JSON is its fields, nothing else: a key that is
    none of them is refused with ``_refusal``."""

    _refusal: ClassVar[str] = "unknown {name} fields {unknown}; expected some of {known}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                cls._refusal.format(name=cls.__name__, known=sorted(known), unknown=sorted(unknown))
            )
        return cls(**data)


@dataclass
class Problem(JsonFields):
    """One RL problem: what the agent reads, the workspace it starts in, and how it is graded."""

    problem_id: str
    """stable id derived from suite, seed, knobs and index, e.g. ``terminal-s7-d1l1-003``"""
    suite: str
    """``repo`` | ``swe`` | ``terminal`` | ``folder``"""
    instruction: str
    files: dict[str, str]
    """workspace template: relative POSIX path -> text"""
    checks: list[Check] = field(default_factory=list)
    """the grader of generated problems and folder checks.py files (see Check); else empty"""
    hidden_tests: dict[str, str] = field(default_factory=dict)
    """files written over the grading copy of the workspace (the hidden tests)"""
    grade_command: str | None = None
    """command graders only: bash script run in the grading copy; it reports as ``grade_output`` says"""
    grade_output: str = "json"
    """command graders only: ``json`` (last stdout line ``{"passed": k, "total": n}``), ``exit_code``
    (0 is reward 1, anything else 0) or ``junit`` (JUnit XML in ``$GYRE_REPORT``, counted per hidden
    test as the built-in pytest grader counts)"""
    grader: str | None = None
    """``"pytest"``: gyre's built-in pytest grader runs the hidden test modules (no checks, no
    grade_command); None: the grader is ``checks`` or ``grade_command``, whichever is given"""
    editable: list[str] | None = None
    """glob patterns (fnmatch, ``*`` crosses ``/``) of the paths the agent may change: only these are
    taken into the grading copy, every other template file is graded in its template version. None:
    everything except the hidden test paths, dot-files and dot-folders, packaging metadata
    (``*.dist-info``, ``*.egg-info``, ``*.pth``) and byte code (grading_copy.py)"""
    visible_test_command: str | None = None
    """what the harness's run_tests tool runs in the agent's workspace (None: no visible tests)"""
    solution: list[dict[str, Any]] = field(default_factory=list)
    """reference tool actions that solve the problem fully (a folder's solution/ and solution.sh);
    empty when a folder gives none"""
    difficulty: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    """free-form, JSON-able facts about the problem (length knob, item count, source folder)"""
    harness: list[str] | None = None
    """the external harness command this problem's suite names (None: the dispatcher's harness);
    the same placeholders as DispatchConfig.harness_command"""
    grade_timeout_s: float | None = None
    """wall clock of one grade of this problem (None: the dispatcher's grade_timeout_s)"""

    def __post_init__(self) -> None:
        self.checks = [c if isinstance(c, Check) else Check(**c) for c in self.checks]
        if self.grader not in (None, "pytest"):
            raise ValueError(
                f'problem {self.problem_id}: grader must be "pytest" or None, got {self.grader!r}'
            )
        given = [bool(self.checks), bool(self.grade_command), self.grader == "pytest"]
        if sum(given) != 1:
            raise ValueError(
                f"problem {self.problem_id}: give exactly one grader, checks, grade_command or "
                f'grader="pytest" (got {len(self.checks)} checks, grade_command={self.grade_command!r}, '
                f"grader={self.grader!r})"
            )
        if self.grade_output not in GRADE_OUTPUTS:
            raise ValueError(
                f"problem {self.problem_id}: grade_output must be one of {list(GRADE_OUTPUTS)}, "
                f"got {self.grade_output!r}"
            )
        if self.grader == "pytest" and not self.hidden_tests:
            raise ValueError(f'problem {self.problem_id}: grader="pytest" needs hidden test files')
        if self.editable is not None and not (
            isinstance(self.editable, list) and all(isinstance(p, str) and p for p in self.editable)
        ):
            raise ValueError(f"problem {self.problem_id}: editable must be a list of glob patterns")
        for path in [*self.files, *self.hidden_tests]:
            check_relative_path(path, what=f"problem {self.problem_id}")
        for step in self.solution:
            if step.get("tool") not in TOOL_NAMES or not isinstance(step.get("arguments"), dict):
                raise ValueError(
                    f"problem {self.problem_id}: solution action {step!r} must be "
                    f'{{"tool": one of {list(TOOL_NAMES)}, "arguments": {{...}}}}'
                )

    def public(self) -> PublicProblem:
        """What a harness may see: no grader, no hidden tests, no solution, no id."""
        return PublicProblem(self.suite, self.instruction, self.visible_test_command)


@dataclass(frozen=True)
class PublicProblem(JsonFields):
    """The part of a problem an execution sees (the JSON handed to every harness)."""

    suite: str
    instruction: str
    visible_test_command: str | None = None

    _refusal = "a harness gets only {known} of a problem; this JSON also has {unknown}"


def check_relative_path(path: str, *, what: str) -> None:
    """Raises ValueError unless ``path`` is a relative POSIX path that stays inside its root."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path:
        raise ValueError(f"{what}: path {path!r} must be relative, use '/', and stay inside the workspace")


def write_workspace(problem: Problem, workspace: str | Path) -> Path:
    """Writes the problem's template files into ``workspace`` (created if missing)."""
    root = Path(workspace)
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in problem.files.items():
        write_text(root, rel, text)
    return root


def write_text(root: Path, rel: str, text: str) -> None:
    target = root / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8", newline="")


def tail(text: str) -> str:
    return text if len(text) <= LOG_TAIL_CHARS else "..." + text[-LOG_TAIL_CHARS:]


def apply_solution(problem: Problem, workspace: str | Path, *, timeout_s: float = 30.0) -> None:
    """Executes the reference actions in ``workspace``: write_file writes, run runs ``bash -c`` there.

    Other tools (reads, run_tests, finish, ...) change nothing and are skipped. A failing command is
    a bug in the generator (or the folder's solution.sh), so it raises SolutionError (a RuntimeError)
    with the command's exit code and output.
    """
    root = Path(workspace)
    for step in problem.solution:
        args = step["arguments"]
        if step["tool"] == "write_file":
            check_relative_path(args["path"], what=f"problem {problem.problem_id}")
            write_text(root, args["path"], args["content"])
        elif step["tool"] == "run":
            _run_reference_command(problem, args["command"], root, timeout_s)


class SolutionError(RuntimeError):
    """A reference solution's command failed: its exit code (None: it timed out) and the ends of
    what it printed, for a reader (``gyre suite check`` shows them line by line)."""

    def __init__(self, problem_id: str, returncode: int | None, stdout: str, stderr: str, timeout_s: float):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        what = f"timed out after {timeout_s:g} s" if returncode is None else f"exited with {returncode}"
        super().__init__(
            f"problem {problem_id}: the reference solution's command {what}\n{self.output_tail()}"
        )

    def output_tail(self, lines: int = 12) -> str:
        """The last ``lines`` lines of its stdout and of its stderr, each under its name."""
        parts = []
        for name, text in (("stdout", self.stdout), ("stderr", self.stderr)):
            kept = text.rstrip().splitlines()[-lines:]
            if kept:
                parts.append(f"{name}:\n" + "\n".join(f"  | {line}" for line in kept))
        return "\n".join(parts) or "(it printed nothing)"


def _run_reference_command(problem: Problem, command: str, workspace: Path, timeout_s: float) -> None:
    """A reference solution's command: trusted generator output, so a plain subprocess (fast)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workspace), "LANG": "C.UTF-8"}
    try:
        done = subprocess.run(
            ["bash", "-c", command], cwd=workspace, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        out, err = (_text(s) for s in (exc.stdout, exc.stderr))
        raise SolutionError(problem.problem_id, None, out, err, timeout_s) from None
    if done.returncode != 0:
        raise SolutionError(problem.problem_id, done.returncode, done.stdout, done.stderr, timeout_s)


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""
