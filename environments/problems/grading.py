"""Grading: a workspace in, a reward out, decided where no code the agent wrote can reach.

Two graders exist (environments/problems/problem.py):

- **checks** (the generated suites): each ``Check``'s probe runs in its own sandboxed command,
  ``<this interpreter> -I -B -`` (isolated: no user site, no PYTHON* variables, neither the
  workspace nor any script folder on the module path unless the check imports the agent's code),
  in a fresh copy of the workspace; the probe reports values with ``observe``, and this process,
  which imports nothing from the workspace, compares them as JSON with the expected values that
  never entered the sandbox. A probe that crashes, hangs, exits early or prints anything else
  loses its check; it cannot fail the grader. The reward is passed / total.
- **a grade command** (user problem folders): a bash script run in a fresh copy of the workspace,
  after the copy is *neutralised* (``neutralise``: pytest configuration and plugins, Python start-up
  hooks and byte code that the agent wrote or changed are removed, template versions restored) and
  the hidden tests are added. Its last stdout line is ``{"passed": k, "total": n}``. Such a grader
  runs the agent's code in its own interpreter; README "Security" says what that leaves open.

Every grade runs in environments/sandbox.py (no network, the checkout and other workspaces
invisible, CPU, memory, process and wall-clock limits), and the agent's workspace is never modified.
``GraderError`` means the grader itself failed (it could not start, or a command grader printed no
summary): the dispatcher retries it, then marks the execution ``eval_failed``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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
        copy = Path(tmp) / "workspace"
        shutil.copytree(source, copy, symlinks=True)
        try:
            sandbox = Sandbox(copy, limits or grading_limits(timeout_s), hide_root=tmp)
            if problem.checks:
                return _grade_checks(problem, sandbox, timeout_s)
            return _grade_command(problem, sandbox, timeout_s)
        except SandboxSetupError as exc:
            raise GraderError(
                f"problem {problem.problem_id}: the grading sandbox could not start: {exc}"
            ) from None


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


def _grade_command(problem: Problem, sandbox: Sandbox, timeout_s: float) -> GradeResult:
    copy = sandbox.workspace
    neutralised = neutralise(copy, problem.files)
    for rel, text in problem.hidden_tests.items():
        place_hidden_file(copy, rel, text)
    result = run_grade_command(problem.grade_command or "", sandbox, timeout_s)
    log = tail(
        ("[neutralised] " + ", ".join(neutralised) + "\n" if neutralised else "")
        + result.stdout
        + ("\n[stderr]\n" + result.stderr if result.stderr.strip() else "")
    )
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


def run_grade_command(command: str, sandbox: Sandbox, timeout_s: float) -> CommandResult:
    """Runs a grader (or visible test) command in the sandbox's workspace.

    ``python`` on PATH is the interpreter running gyrerl: where it is only called e.g. python3.11,
    a link named ``python`` is made in ``.gyre_bin`` of the workspace (whatever stood there is
    removed first), and PYTHONNOUSERSITE keeps user site-packages out.
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
