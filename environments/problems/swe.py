"""The ``swe`` suite (DeepSWE-like): fix planted bugs in a small Python repository.

The workspace holds one module of one-line functions, a visible test script (``run_tests``) and some
distracting files. ``difficulty`` functions carry a planted bug (an operator, constant, method or
literal changed), and the instruction names each one and what it should return, e.g.

    Fix the bug in calc.py: the function scale_price returns x * 3 - 2, but it should return
    x * 3 + 2. Keep the other functions as they are.

The reference solution reads the module and writes it back fixed. The hidden grader has one check
per bug: the fixed function gives the right results on three calls AND every function that was never
broken still works (SWE-bench's pass-to-pass guard), so rewriting the file carelessly earns nothing.
Knobs: ``difficulty`` = bugs and distracting files; ``length`` = extra healthy functions in the module.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from typing import Any

from environments.problems.checks import grader_script, suite_problem
from environments.problems.problem import Problem
from environments.problems.registry import (
    action,
    noise_files,
    problem_id,
    register_suite,
)
from environments.problems.repo import (
    STR_SUFFIXES,
    FunctionSpec,
    all_args,
    call_check,
    call_results,
    import_line,
    module_source,
    random_function,
    sample_args,
)

MODULE_NAMES = ("calc", "pricing", "textops", "stats", "helpers", "convert", "report", "ledger")
Args = tuple[Any, ...]
_OPERATOR_SWAPS = {" + ": " - ", " - ": " + ", " * ": " + "}
_METHOD_SWAPS = {".upper()": ".lower()", ".lower()": ".upper()", ".title()": ".upper()", "[::-1]": "[1:]"}


def _bug_sites(spec: FunctionSpec) -> list[tuple[int, int, str]]:
    """Every single-token change that can plant a bug: (start, end, replacement)."""
    sites = []
    body = spec.body
    swaps = _OPERATOR_SWAPS if spec.kind == "int" else _METHOD_SWAPS  # str - str would only crash
    for token, swap in swaps.items():
        sites += [(m.start(), m.end(), swap) for m in re.finditer(re.escape(token), body)]
    for m in re.finditer(r"\b\d\b", body):
        sites.append((m.start(), m.end(), str(int(m.group()) + 1)))
    for m in re.finditer(r' \+ "([^"]*)"', body):
        other = next(s for s in STR_SUFFIXES if s != m.group(1))
        sites.append((m.start(), m.end(), f' + "{other}"'))
    return sites


def plant_bug(rng: random.Random, spec: FunctionSpec) -> tuple[FunctionSpec, list[Args]] | None:
    """The function with one change that alters its results, and the arguments that show it.

    None when no single change alters any result.
    """
    candidates = all_args(spec)
    want = call_results(spec, candidates)
    sites = _bug_sites(spec)
    rng.shuffle(sites)
    for start, end, new in sites:
        buggy = replace(spec, body=spec.body[:start] + new + spec.body[end:])
        got = call_results(buggy, candidates)
        witnesses = [args for args, w, g in zip(candidates, want, got, strict=True) if w != g]
        if witnesses:
            return buggy, witnesses
    return None


@register_suite("swe")
def generate_swe(n: int, *, seed: int, difficulty: int, length: int) -> list[Problem]:
    return [_one(seed, difficulty, length, index) for index in range(n)]


def _one(seed: int, difficulty: int, length: int, index: int) -> Problem:
    rng = random.Random(problem_id("swe", seed, difficulty, length, index))
    module = rng.choice(MODULE_NAMES)
    n_functions = difficulty + length
    bug_indices = set(rng.sample(range(n_functions), difficulty))
    taken: set[str] = set()
    correct: list[FunctionSpec] = []
    shipped: list[FunctionSpec] = []  # what the workspace holds: bugs planted
    witnesses: dict[str, list[Args]] = {}  # buggy function -> arguments on which the bug shows
    for i in range(n_functions):
        while True:
            spec = random_function(rng, taken, rng.randint(1, 2))
            planted = plant_bug(rng, spec) if i in bug_indices else (spec, [])
            if planted is not None:
                break
        correct.append(spec)
        shipped.append(planted[0])
        if i in bug_indices:
            witnesses[spec.name] = planted[1]

    bugs = [(c, s) for c, s in zip(correct, shipped, strict=True) if c.name in witnesses]
    healthy = [c for c in correct if c.name not in witnesses]
    path = f"{module}.py"
    explain = [f"the function {s.name} returns {s.body}, but it should return {c.body}" for c, s in bugs]
    if len(bugs) == 1:
        instruction = f"Fix the bug in {path}: {explain[0]}."
    else:
        items = "\n".join(f"- {e[0].upper()}{e[1:]}." for e in explain)
        instruction = f"Fix the {len(bugs)} bugs in {path}:\n{items}"
    instruction += "\nKeep the other functions as they are. run_tests runs the visible tests."

    def probe_args(spec: FunctionSpec, count: int) -> list[Args]:
        """``count`` distinct calls; for a buggy function the first one exposes the bug."""
        if spec.name not in witnesses:
            return sample_args(rng, spec, count)
        first = rng.choice(witnesses[spec.name])
        return [first, *rng.sample([a for a in all_args(spec) if a != first], count - 1)]

    guard = [call_check(module, h, probe_args(h, 1)) for h in healthy]
    checks = [
        (
            f"fixed {fixed.name}",
            "\n".join([import_line(module), *guard, call_check(module, fixed, probe_args(fixed, 3))]),
        )
        for fixed, _ in bugs
    ]
    visible = [
        (c.name, import_line(module) + "\n" + call_check(module, c, probe_args(c, 1))) for c in correct
    ]

    docstring = f"{module}: small helpers."
    visible_path = f"tests/check_{module}.py"
    files = {
        path: module_source(shipped, docstring),
        visible_path: grader_script(visible),
        "README.md": f"# {module}\n\nHelpers in {path}; tests in {visible_path}.\n",
    }
    files |= noise_files(rng, difficulty - 1, set(files))
    solution = [
        action("read_file", path=path),
        action("write_file", path=path, content=module_source(correct, docstring)),
        action("run_tests"),
        action("finish", summary=f"Fixed {len(bugs)} bug{'s' if len(bugs) > 1 else ''} in {path}."),
    ]
    meta = {"items": len(bugs), "functions": n_functions}
    knobs = (seed, difficulty, length, index)
    return suite_problem("swe", knobs, instruction, files, checks, solution, visible_path, meta)
