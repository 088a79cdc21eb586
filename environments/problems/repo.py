"""The ``repo`` suite (NL2RepoBench-like): write a small module or package from a specification.

The specification lists every function with its parameters and the one expression it returns, e.g.

    Create the Python module shapes.py with these functions:
    - scale_price(x): return x * 3 + 2
    - shout_name(s): return s.upper() + "!"

so a tiny policy can learn to solve it by copying and reformatting text. The hidden grader has one
check per function (three calls with known results), so the reward is the fraction of functions
written correctly. Knobs: ``difficulty`` = number of functions (from 4 on, split over two modules of
a package) and distracting files in the workspace; ``length`` = operations per expression.

The function generator (``random_function``, ``call_results``) is shared with the swe suite.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any, Literal

from environments.problems.checks import grader_script, suite_problem
from environments.problems.problem import Problem
from environments.problems.registry import (
    WORDS,
    action,
    noise_files,
    problem_id,
    register_suite,
)

MODULE_NAMES = (
    "shapes",
    "money",
    "grades",
    "inventory",
    "weather",
    "textkit",
    "scores",
    "units",
    "recipes",
    "garden",
)
INT_VERBS = ("scale", "shift", "boost", "mix", "fold", "tally", "bump", "pack", "stretch", "split")
STR_VERBS = ("shout", "clean", "tag", "flip", "echo", "wrap", "mark", "label", "dress", "trim")
NOUNS = (
    "price",
    "score",
    "total",
    "width",
    "level",
    "speed",
    "name",
    "title",
    "code",
    "note",
    "item",
    "color",
)
INT_INPUTS = (-3, -1, 0, 1, 2, 3, 4, 5, 7, 10)
STR_INPUTS = ("Hello", "abc", "banana", "Data Set", "tiny", "Mango", "a b c", "Zebra")
STR_SUFFIXES = ("!", "?", "-ok", ".", " end")


@dataclass(frozen=True)
class FunctionSpec:
    """A one-line Python function: ``def name(params): return body``."""

    name: str
    params: tuple[str, ...]
    body: str
    kind: Literal["int", "str"]

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(self.params)})"

    def source(self) -> str:
        return f"def {self.signature}:\n    return {self.body}\n"

    def spec_line(self) -> str:
        return f"- {self.signature}: return {self.body}"


def module_source(functions: list[FunctionSpec], docstring: str) -> str:
    return f'"""{docstring}"""\n\n\n' + "\n\n".join(f.source() for f in functions)


def _int_body(rng: random.Random, params: tuple[str, ...], length: int) -> str:
    body = params[0]
    for step in range(length):
        op = rng.choice(("+", "-", "*"))
        if len(params) > 1 and (step == 0 or rng.random() < 0.3):
            operand = params[1] if step == 0 else rng.choice(params)
        else:
            operand = str(rng.randint(2, 9))
        body = f"{body} {op} {operand}"
    return body


def _str_body(rng: random.Random, length: int) -> str:
    body, compound = "s", False
    for _ in range(length):
        atom = f"({body})" if compound else body
        choice = rng.randrange(5)
        if choice == 0:
            body, compound = f"{atom}.{rng.choice(('upper', 'lower', 'title'))}()", False
        elif choice == 1:
            body, compound = f"{atom}[::-1]", False
        elif choice == 2:
            old, new = rng.sample("aeiou", 2)
            body, compound = f'{atom}.replace("{old}", "{new}")', False
        elif choice == 3:
            body, compound = f"{atom} * {rng.randint(2, 3)}", True
        else:
            body, compound = f'{body} + "{rng.choice(STR_SUFFIXES)}"', True
    return body


def random_function(rng: random.Random, taken: set[str], length: int) -> FunctionSpec:
    """A fresh one-line function whose name is not in ``taken`` (which is updated)."""
    while True:
        kind: Literal["int", "str"] = rng.choice(("int", "str"))
        verb = rng.choice(INT_VERBS if kind == "int" else STR_VERBS)
        name = f"{verb}_{rng.choice(NOUNS)}"
        if name not in taken:
            break
    taken.add(name)
    if kind == "int":
        params = ("x",) if rng.random() < 0.6 else ("a", "b")
        return FunctionSpec(name, params, _int_body(rng, params, length), kind)
    return FunctionSpec(name, ("s",), _str_body(rng, length), kind)


def all_args(spec: FunctionSpec) -> list[tuple[Any, ...]]:
    """Every argument tuple the tests may call the function with."""
    pool = INT_INPUTS if spec.kind == "int" else STR_INPUTS
    return list(itertools.product(pool, repeat=len(spec.params)))


def sample_args(rng: random.Random, spec: FunctionSpec, count: int) -> list[tuple[Any, ...]]:
    """``count`` distinct argument tuples for the function."""
    return rng.sample(all_args(spec), count)


def call_results(spec: FunctionSpec, args_list: list[tuple[Any, ...]]) -> list[Any]:
    """What the function returns for each argument tuple (runs the generated one-liner)."""
    namespace: dict[str, Any] = {}
    exec(spec.source(), namespace)
    return [namespace[spec.name](*args) for args in args_list]


def call_check(module: str, spec: FunctionSpec, args_list: list[tuple[Any, ...]]) -> str:
    """Check code: ``module.name(*args)`` equals what the reference function returns, for each args."""
    lines = []
    for args, want in zip(args_list, call_results(spec, args_list), strict=True):
        call = f"{spec.name}({', '.join(repr(a) for a in args)})"
        lines.append(f"expect_equal(_m.{call}, {want!r}, {call!r})")
    return "\n".join(lines)


def import_line(module: str) -> str:
    """``import a`` or ``from pkg import a as _m`` style, always binding the module to ``_m``."""
    package, _, leaf = module.rpartition(".")
    return f"from {package} import {leaf} as _m" if package else f"import {module} as _m"


@register_suite("repo")
def generate_repo(n: int, *, seed: int, difficulty: int, length: int) -> list[Problem]:
    return [_one(seed, difficulty, length, index) for index in range(n)]


def _one(seed: int, difficulty: int, length: int, index: int) -> Problem:
    rng = random.Random(problem_id("repo", seed, difficulty, length, index))
    taken: set[str] = set()
    functions = [random_function(rng, taken, length) for _ in range(difficulty)]
    name = rng.choice(MODULE_NAMES)
    if difficulty < 4:
        modules = {name: functions}
        layout = f"Create the Python module {name}.py with these functions:"
    else:
        half = (difficulty + 1) // 2
        first, second = rng.sample([w for w in WORDS if w != name], 2)
        modules = {f"{name}.{first}": functions[:half], f"{name}.{second}": functions[half:]}
        layout = f"Create the Python package {name}/ (with an empty {name}/__init__.py) and these modules:"

    spec_lines = [layout]
    for module, funcs in modules.items():
        if len(modules) > 1:
            spec_lines.append(f"{module_path(module)}:")
        spec_lines += [f.spec_line() for f in funcs]
    spec_lines.append("Each function returns the expression shown. Hidden tests call every function.")
    instruction = "\n".join(spec_lines)

    checks, visible = [], []
    for module, funcs in modules.items():
        for spec in funcs:
            args = sample_args(rng, spec, 4)
            checks.append((spec.name, import_line(module) + "\n" + call_check(module, spec, args[:3])))
            visible.append((spec.name, import_line(module) + "\n" + call_check(module, spec, args[3:])))

    visible_path = f"tests/check_{name}.py"
    files = {"README.md": f"# {name}\n\nA small Python project. The specification is in the task.\n"}
    files[visible_path] = grader_script(visible)
    files |= noise_files(rng, difficulty - 1, set(files))

    solution = []
    if len(modules) > 1:
        solution.append(action("write_file", path=f"{name}/__init__.py", content=""))
    for module, funcs in modules.items():
        solution.append(
            action(
                "write_file", path=module_path(module), content=module_source(funcs, f"{module} functions.")
            )
        )
    solution += [
        action("run_tests"),
        action(
            "finish", summary=f"Wrote {len(functions)} function{'s' if len(functions) > 1 else ''} in {name}."
        ),
    ]
    meta = {"items": len(functions), "modules": [module_path(m) for m in modules]}
    knobs = (seed, difficulty, length, index)
    return suite_problem("repo", knobs, instruction, files, checks, solution, visible_path, meta)


def module_path(module: str) -> str:
    return module.replace(".", "/") + ".py"
