"""The check language of generated problems, and the two forms a check takes.

A suite writes each check as a few lines of Python over three helpers::

    import shapes as _m
    expect_equal(_m.scale_price(3), 11, 'scale_price(3)')      # repo / swe: call the agent's code
    expect(not Path('a.txt').exists(), 'a.txt still exists')   # terminal: look at files

The same text becomes

- a **visible test** (``grader_script``): a standalone script in the agent's workspace that runs
  every check and prints PASS/FAIL lines, for the harness's run_tests tool;
- a **hidden check** (``compile_check``): a ``Check`` whose probe keeps only the observed side of
  every expectation (``observe(_m.scale_price(3))``) and whose expected values (``[11]``) stay with
  the grading process. environments/problems/grading.py runs the probe in a sandbox and compares.

``suite_problem`` makes a generated problem of a suite's checks (and its knobs, files and solution).

Why split: code the agent wrote runs inside a probe, and code that runs can print, patch, exit or
lie about anything in its own process. It cannot make the grading process see a value it did not
produce, so the verdict is taken where no agent code runs, on data.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from environments.problems.problem import Check, Problem
from environments.problems.registry import problem_id

CHECK_TIMEOUT_S = 2
"""Per-check alarm of a visible test script."""

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

_VISIBLE_TEMPLATE = '''"""Tests: runs each check, prints PASS/FAIL lines, then {{"passed": k, "total": n}} last."""
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


def grader_script(checks: list[tuple[str, str]], *, helpers: str = CHECK_HELPERS) -> str:
    """A standalone test script that runs each (name, code) check and prints the summary line.

    Checks run in the workspace (cwd, also first on sys.path). This is the form of the *visible*
    tests an agent may run; hidden checks are never graded this way (see ``compile_check``).
    """
    if not checks:
        raise ValueError("a test script needs at least one check")
    return _VISIBLE_TEMPLATE.format(helpers=helpers, checks=checks, timeout=CHECK_TIMEOUT_S)


def compile_check(name: str, code: str) -> Check:
    """The hidden form of one check: ``expect_equal(got, want, what)`` becomes ``observe(got)`` with
    ``want`` expected; ``expect(cond, message)`` becomes ``observe(bool(cond))`` with True expected.

    Only imports and those two calls may appear at the top level. A check that imports code (the
    agent's) may use only ``expect_equal``: ``bool(cond)`` of an object the agent made is whatever
    its ``__bool__`` says, so it would be decided inside agent code.
    """
    tree = ast.parse(code, filename=name)
    body: list[ast.stmt] = []
    expected: list[Any] = []
    imports = any(isinstance(s, ast.Import | ast.ImportFrom) for s in tree.body)
    for statement in tree.body:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            body.append(statement)
            continue
        call = statement.value if isinstance(statement, ast.Expr) else None
        func = call.func.id if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) else None
        if func == "expect_equal" and len(call.args) == 3:
            try:
                want = ast.literal_eval(call.args[1])
            except ValueError:
                raise ValueError(f"check {name!r}: the expected value must be a literal: {code}") from None
            observed = call.args[0]
        elif func == "expect" and len(call.args) == 2 and not imports:
            want = True
            observed = ast.Call(ast.Name("bool", ast.Load()), [call.args[0]], [])
        else:
            raise ValueError(
                f"check {name!r}: a hidden check holds imports and expect_equal(got, want, what) calls"
                f"{'' if imports else ' or expect(condition, message) calls'} only; got: "
                f"{ast.unparse(statement)}"
            )
        expected.append(json.loads(json.dumps(want)))
        body.append(ast.Expr(ast.Call(ast.Name("observe", ast.Load()), [observed], [])))
    if not expected:
        raise ValueError(f"check {name!r} expects nothing: {code!r}")
    probe = ast.unparse(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])))
    return Check(name=name, probe=probe, expected=expected, imports_workspace=imports)


def suite_problem(
    suite: str,
    knobs: tuple[int, int, int, int],
    instruction: str,
    files: dict[str, str],
    checks: list[tuple[str, str]],
    solution: list[dict[str, Any]],
    visible_path: str | None,
    meta: dict[str, Any],
) -> Problem:
    """A generated problem of ``suite``: ``knobs`` (seed, difficulty, length, index) give its stable id,
    its ``checks`` ((name, code) pairs) are compiled (checks.compile_check), the harness's run_tests runs
    the script at ``visible_path`` (None: the suite ships no visible tests), and ``meta`` gets the
    length knob."""
    seed, difficulty, length, index = knobs
    return Problem(
        problem_id=problem_id(suite, seed, difficulty, length, index),
        suite=suite,
        instruction=instruction,
        files=files,
        checks=[compile_check(name, code) for name, code in checks],
        visible_test_command=None if visible_path is None else f"python -B {visible_path}",
        solution=solution,
        difficulty=difficulty,
        meta={"length": length, **meta},
    )
