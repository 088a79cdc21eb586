"""Problems, their graders, and the registry of generated suites.

A problem is an instruction, a workspace template (relative path -> text) and a grader: hidden test
files that are copied into a fresh copy of the agent's workspace, plus a grade command that prints
``{"passed": k, "total": n}`` as its last stdout line. The reward is k / n, so graders give partial
credit. Generated problems also carry a reference solution (a list of harness tool actions,
``{"tool": name, "arguments": {...}}``) that solves them fully: it becomes a supervised
demonstration and, in the tests, proof that the grader can be satisfied.

Grade commands run in environments/sandbox.py (they execute agent code). Generated graders are one
Python script (``grader_script``) that runs each check in try/except with a per-check alarm, so a
broken or hanging solution loses the check instead of crashing the grader.

    problem = generate("terminal", 1, seed=7)[0]
    write_workspace(problem, ws)          # the template the agent starts from
    apply_solution(problem, ws)           # the reference actions (demonstrations, tests)
    grade_workspace(problem, ws).reward   # 1.0

The suites (repo.py, swe.py, terminal.py) register themselves in ``SUITES``; folder.py loads
user-provided problems from disk.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from environments.sandbox import CommandResult, Sandbox, SandboxLimits, SandboxSetupError

GRADER_PATH = ".gyre_hidden/grade.py"
"""Where generated problems put their hidden grader script (relative to the workspace)."""
GRADER_COMMAND = f"python -B {GRADER_PATH}"
LOG_TAIL_CHARS = 4000
TOOLS = ("list_files", "read_file", "write_file", "run", "run_tests", "delegate", "finish")
"""The harness's tool names; every solution action names one of them."""


class GraderError(RuntimeError):
    """The grader itself failed (crash, timeout, unreadable output): the execution is not graded."""


@dataclass
class Problem:
    """One RL problem: what the agent reads, the workspace it starts in, and how it is graded."""

    problem_id: str
    """stable id derived from suite, seed, knobs and index, e.g. ``terminal-s7-d1l1-003``"""
    suite: str
    """``repo`` | ``swe`` | ``terminal`` | ``folder``"""
    instruction: str
    files: dict[str, str]
    """workspace template: relative POSIX path -> text"""
    hidden_tests: dict[str, str]
    """files added to the grading copy of the workspace only; the agent never sees them"""
    grade_command: str
    """bash command run in the grading copy; its last stdout line is ``{"passed": k, "total": n}``"""
    visible_test_command: str | None = None
    """what the harness's run_tests tool runs in the agent's workspace (None: no visible tests)"""
    solution: list[dict[str, Any]] = field(default_factory=list)
    """reference tool actions that solve the problem fully; empty for folder problems"""
    difficulty: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    """free-form, JSON-able facts about the problem (length knob, item count, source folder)"""

    def __post_init__(self) -> None:
        for path in [*self.files, *self.hidden_tests]:
            check_relative_path(path, what=f"problem {self.problem_id}")
        for action in self.solution:
            if action.get("tool") not in TOOLS or not isinstance(action.get("arguments"), dict):
                raise ValueError(
                    f"problem {self.problem_id}: solution action {action!r} must be "
                    f'{{"tool": one of {list(TOOLS)}, "arguments": {{...}}}}'
                )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Problem:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Problem fields {unknown}; expected some of {sorted(known)}")
        return cls(**data)


@dataclass
class GradeResult:
    """What grading one workspace gave."""

    reward: float
    """passed / total, in [0, 1]"""
    passed: int
    total: int
    log: str
    """tail of the grader's stdout and stderr"""


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
        _write_text(root, rel, text)
    return root


def _write_text(root: Path, rel: str, text: str) -> None:
    target = root / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8", newline="")


# ---------------------------------------------------------------------------------------- grading


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


def grading_limits(timeout_s: float) -> SandboxLimits:
    """Sandbox limits of one grade command: the grader's own timeout, room for a test suite's memory."""
    return SandboxLimits(cpu_s=max(1, math.ceil(timeout_s)), memory_bytes=4 << 30, command_wall_s=timeout_s)


def run_grade_command(
    command: str, workspace: Path, timeout_s: float, limits: SandboxLimits | None = None
) -> CommandResult:
    """Runs one grader (or visible test) command in ``workspace``: the one place that starts them.

    It runs in environments/sandbox.py (no network, writes only inside the workspace, CPU, memory and
    process limits, the whole process tree killed at the timeout) because it executes agent code.
    ``python`` on PATH is the interpreter running gyrerl.
    """
    sandbox = Sandbox(workspace, limits or grading_limits(timeout_s))
    if not (Path(sys.executable).parent / "python").exists():
        # the interpreter is called e.g. python3.11 only: name it `python` in a folder the command sees
        shim = Path(workspace) / ".gyre_bin"
        shim.mkdir(exist_ok=True)
        (shim / "python").symlink_to(sys.executable)
        sandbox.env["PATH"] = f"{shim}{os.pathsep}{sandbox.env['PATH']}"
    sandbox.env["PYTHONIOENCODING"] = "utf-8"
    try:
        return sandbox.run(command, timeout_s=timeout_s)
    except SandboxSetupError as exc:
        raise GraderError(f"the grading sandbox could not start: {exc}") from None


def grade_workspace(
    problem: Problem, workspace: str | Path, *, timeout_s: float = 60.0, limits: SandboxLimits | None = None
) -> GradeResult:
    """Grades a workspace: a fresh copy of it plus the hidden tests, then the grade command.

    The agent's workspace is never modified; ``limits`` overrides ``grading_limits(timeout_s)``. Raises GraderError when the grade command times out or
    does not end with the ``{"passed": k, "total": n}`` line (a failed test is not a grader error).
    """
    source = Path(workspace)
    if not source.is_dir():
        raise GraderError(f"problem {problem.problem_id}: workspace {source} is not a directory")
    with tempfile.TemporaryDirectory(prefix="gyre-grade-") as tmp:
        root = Path(tmp)
        copy = root / "workspace"
        shutil.copytree(source, copy, symlinks=True)
        for rel, text in problem.hidden_tests.items():
            _place_hidden_file(copy, rel, text)
        result = run_grade_command(problem.grade_command, copy, timeout_s, limits)
    log = _tail(result.stdout + ("\n[stderr]\n" + result.stderr if result.stderr.strip() else ""))
    if result.timed_out:
        raise GraderError(f"problem {problem.problem_id}: grader timed out after {timeout_s:g} s\n{log}")
    try:
        passed, total = parse_grade_output(result.stdout)
    except GraderError as exc:
        limit = f", stopped by its {result.limit} limit" if result.limit else ""
        raise GraderError(
            f"problem {problem.problem_id}: {exc} (exit code {result.returncode}{limit})\n{log}"
        ) from None
    return GradeResult(reward=passed / total, passed=passed, total=total, log=log)


def _place_hidden_file(root: Path, rel: str, text: str) -> None:
    """Writes a hidden file; whatever the agent left on its path (a link out, a folder) gives way."""
    current = root
    for part in PurePosixPath(rel).parts:
        current = current / part
        # a link could point out of the copy; a file where a folder belongs would block mkdir
        if current.is_symlink() or (current.is_file() and current != root / rel):
            current.unlink()
    if (root / rel).is_dir():
        shutil.rmtree(root / rel)
    _write_text(root, rel, text)


def _tail(text: str) -> str:
    return text if len(text) <= LOG_TAIL_CHARS else "..." + text[-LOG_TAIL_CHARS:]


def apply_solution(problem: Problem, workspace: str | Path, *, timeout_s: float = 30.0) -> None:
    """Executes the reference actions in ``workspace``: write_file writes, run runs ``bash -c`` there.

    Other tools (reads, run_tests, finish, ...) change nothing and are skipped. A failing command is
    a bug in the generator, so it raises RuntimeError with the command's output.
    """
    root = Path(workspace)
    for step in problem.solution:
        args = step["arguments"]
        if step["tool"] == "write_file":
            check_relative_path(args["path"], what=f"problem {problem.problem_id}")
            _write_text(root, args["path"], args["content"])
        elif step["tool"] == "run":
            _run_reference_command(problem, args["command"], root, timeout_s)


def _run_reference_command(problem: Problem, command: str, workspace: Path, timeout_s: float) -> None:
    """A reference solution's command: trusted generator output, so a plain subprocess (fast)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workspace), "LANG": "C.UTF-8"}
    try:
        done = subprocess.run(
            ["bash", "-c", command], cwd=workspace, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"problem {problem.problem_id}: solution command {command!r} timed out") from None
    if done.returncode != 0:
        raise RuntimeError(
            f"problem {problem.problem_id}: solution command {command!r} failed "
            f"(exit {done.returncode}):\n{_tail(done.stdout + done.stderr)}"
        )


# ------------------------------------------------------------------------------ generated graders

CHECK_TIMEOUT_S = 2
_GRADER_TEMPLATE = '''"""Hidden grader: runs each check, prints PASS/FAIL lines, then {{"passed": k, "total": n}} last."""
import json
import os
import signal
import sys

sys.path.insert(0, os.getcwd())

HELPERS = {helpers!r}
CHECKS = {checks!r}


def _too_slow(signum, frame):
    raise TimeoutError("check took longer than {timeout} s")


signal.signal(signal.SIGALRM, _too_slow)
base = {{"__name__": "gyre_check"}}
exec(HELPERS, base)
passed = 0
for name, code in CHECKS:
    signal.alarm({timeout})
    try:
        exec(compile(code, name, "exec"), dict(base))
        passed += 1
        print("PASS", name)
    except BaseException as exc:  # the checked code may raise anything, SystemExit included
        print("FAIL", name, "-", type(exc).__name__, str(exc)[:300])
    finally:
        signal.alarm(0)
for stream in (sys.stdout, sys.__stdout__):
    try:
        stream.flush()
    except Exception:
        pass
summary = json.dumps({{"passed": passed, "total": len(CHECKS)}})
os.write(1, ("\\n" + summary + "\\n").encode())
'''

CHECK_HELPERS = '''
from pathlib import Path


def lines_of(path):
    """The file's lines without trailing whitespace, trailing blank lines dropped."""
    out = [line.rstrip() for line in Path(path).read_text().splitlines()]
    while out and not out[-1]:
        out.pop()
    return out


def expect_equal(got, want, what):
    if got != want:
        raise AssertionError(f"{what}: expected {want!r}, got {got!r}")


def expect(condition, message):
    if not condition:
        raise AssertionError(message)
'''


def grader_script(checks: list[tuple[str, str]], *, helpers: str = CHECK_HELPERS) -> str:
    """A standalone Python script that runs each (name, code) check and prints the summary line.

    Checks run in the workspace (cwd, also first on sys.path) with ``lines_of``, ``expect`` and
    ``expect_equal`` in scope; a check passes when its code raises nothing within the time limit.
    """
    if not checks:
        raise ValueError("a grader needs at least one check")
    return _GRADER_TEMPLATE.format(helpers=helpers, checks=checks, timeout=CHECK_TIMEOUT_S)


def action(tool: str, **arguments: Any) -> dict[str, Any]:
    """One solution step in the harness's shape: ``{"tool": tool, "arguments": {...}}``."""
    return {"tool": tool, "arguments": arguments}


# ---------------------------------------------------------------------------------------- registry

SuiteGenerator = Callable[..., list[Problem]]
SUITES: dict[str, SuiteGenerator] = {}
"""suite name -> generator(n, *, seed, difficulty, length); filled by the suite modules at import."""


def register_suite(name: str) -> Callable[[SuiteGenerator], SuiteGenerator]:
    def register(generator: SuiteGenerator) -> SuiteGenerator:
        if name in SUITES:
            raise ValueError(f"suite {name!r} is registered twice")
        SUITES[name] = generator
        return generator

    return register


def generate(suite: str, n: int, *, seed: int = 0, difficulty: int = 1, length: int = 1) -> list[Problem]:
    """``n`` problems of a suite; the same arguments always give the same problems.

    difficulty: how many required items (files to change, functions to write, bugs to fix) and how
    many distracting files; length: how much text each item carries (lines, expression size, module
    size). Both start at 1.
    """
    if suite not in SUITES:
        raise ValueError(f"unknown problem suite {suite!r}; known suites: {sorted(SUITES)}")
    if n < 0 or difficulty < 1 or length < 1:
        raise ValueError(f"need n >= 0, difficulty >= 1 and length >= 1; got n={n}, {difficulty=}, {length=}")
    return SUITES[suite](n, seed=seed, difficulty=difficulty, length=length)


def problem_id(suite: str, seed: int, difficulty: int, length: int, index: int) -> str:
    """Stable id: distinct for every (suite, seed, difficulty, length, index)."""
    return f"{suite}-s{seed}-d{difficulty}l{length}-{index:03d}"


def problem_rng_seed(suite: str, seed: int, difficulty: int, length: int, index: int) -> str:
    """The string seed of one problem's random.Random (string seeds are stable across runs)."""
    return problem_id(suite, seed, difficulty, length, index)


# ------------------------------------------------------------------------------ shared vocabulary

WORDS = (
    "apple", "river", "stone", "cloud", "paper", "green", "quick", "silver", "garden", "window",
    "orange", "market", "pencil", "rocket", "winter", "summer", "castle", "forest", "candle", "bridge",
    "yellow", "butter", "engine", "planet", "spring", "ticket", "violet", "wallet", "dragon", "letter",
)  # fmt: skip
NOISE_DIRS = ("misc", "old", "drafts", "archive", "scratch")


def words(rng, count: int) -> str:
    """``count`` random vocabulary words joined by spaces (plain ASCII, no shell-special characters)."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


def noise_files(rng, count: int, taken: set[str]) -> dict[str, str]:
    """``count`` distracting text files at paths not in ``taken`` (which is updated)."""
    files: dict[str, str] = {}
    while len(files) < count:
        path = f"{rng.choice(NOISE_DIRS)}/{rng.choice(WORDS)}_{rng.randint(1, 99)}.txt"
        if path in taken:
            continue
        taken.add(path)
        files[path] = "\n".join(words(rng, rng.randint(2, 5)) for _ in range(rng.randint(1, 3))) + "\n"
    return files
