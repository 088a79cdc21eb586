"""Opening a suite: built-in generators, problem folders, manifests and plugins, all one way.

A suite is anything that yields problems. Two shapes exist:

- a **generated** suite (``GeneratedSuite``): infinite and seeded, ``generate(n, seed=, difficulty=,
  length=)`` gives the same problems for the same arguments (repo, swe, terminal);
- a **finite** suite (``FiniteSuite``): a fixed list of problems (a folder of problem folders, a JSONL
  or Parquet manifest, or what a plugin returns).

Plugins are Python objects named by an entry point of the ``gyrerl.suites`` group (a package's
``[project.entry-points."gyrerl.suites"]``) or by a ``module:function`` spec. The object is a
GeneratedSuite, an iterable of Problem (or Problem JSON), or a callable returning either (called with
the spec's ``path`` when one is given). The built-in generators are such plugins too: pyproject.toml
declares them as entry points, and BUILTIN below names the same objects, so a checkout that was never
installed still has them.

A finite suite's problems get ``suite`` = the suite's name and ids that start with ``<name>-`` (a
folder problem ``folder-fix-parser`` of suite ``mine`` becomes ``mine-fix-parser``), so ids are unique
across the suites of a campaign and the per-suite figures find their suite.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from environments.problems import Problem, read_folder
from environments.problems.registry import SUITES, SuiteGenerator
from environments.suites.manifest import read_manifest, record_problem
from environments.suites.spec import SuiteSpec

ENTRY_POINT_GROUP = "gyrerl.suites"
MANIFEST_SUFFIXES = (".jsonl", ".parquet")


class SuiteError(ValueError):
    """A suite could not be opened, or one of its problems is malformed; the message names it."""


@dataclass(frozen=True)
class GeneratedSuite:
    """An infinite, seeded suite: ``generate(n, seed=, difficulty=, length=)`` -> list[Problem]."""

    generate: SuiteGenerator
    description: str = ""


@dataclass
class FiniteSuite:
    """A fixed list of problems, with the messages of those that could not be read."""

    problems: list[Problem]
    errors: list[str]


repo = GeneratedSuite(SUITES["repo"], "NL2RepoBench-like: write a module from a specification")
swe = GeneratedSuite(SUITES["swe"], "DeepSWE-like: fix planted bugs in a small repository")
terminal = GeneratedSuite(SUITES["terminal"], "TerminalBench-like: reach a target file-system state")
BUILTIN: dict[str, str] = {
    "repo": "environments.suites.sources:repo",
    "swe": "environments.suites.sources:swe",
    "terminal": "environments.suites.sources:terminal",
}
"""The built-in suites, named as their entry points in pyproject.toml name them."""


def installed_suites() -> dict[str, str]:
    """Suite name -> ``module:attribute`` of every suite known: the built-ins and the installed plugins."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return {**found, **BUILTIN}


def load_object(reference: str) -> Any:
    """The object a ``module:attribute`` spec (or a ``gyrerl.suites`` entry point's name) names."""
    target = installed_suites().get(reference, reference)
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise SuiteError(
            f"suite plugin {reference!r} is neither module:function nor an installed suite "
            f"(installed: {sorted(installed_suites())})"
        )
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as exc:
        raise SuiteError(f"suite plugin {target!r} could not be loaded: {exc}") from None
    return value


def open_suite(spec: SuiteSpec) -> GeneratedSuite | FiniteSuite:
    """The suite a spec names, with a finite suite's problems renamed into the suite (see the module
    docstring). Raises SuiteError when nothing can be read; a finite suite's broken problems are in
    its ``errors``."""
    if spec.entry_point is not None:
        plugin = load_object(spec.entry_point)
        found = _from_plugin(plugin, spec.entry_point, spec.path)
    elif spec.path is not None:
        try:
            found = _from_path(Path(spec.path))
        except SuiteError as exc:
            raise SuiteError(f"suite {spec.name}: {exc}") from None
    elif spec.name in installed_suites():
        found = _from_plugin(load_object(spec.name), spec.name, None)
    else:
        raise SuiteError(
            f"suite {spec.name!r} has no path or entry_point and is no known suite "
            f"(known: {sorted(installed_suites())})"
        )
    if isinstance(found, GeneratedSuite):
        return found
    return FiniteSuite(_into_suite(spec, found.problems), found.errors)


def _from_path(path: Path) -> FiniteSuite:
    if path.is_dir():
        loaded = read_folder(path)
        return FiniteSuite(loaded.problems, loaded.errors)
    if not path.exists():
        raise SuiteError(f"no such folder or file: {path}")
    if path.suffix not in MANIFEST_SUFFIXES:
        raise SuiteError(
            f"{path} is neither a folder of problem folders nor a manifest ({' or '.join(MANIFEST_SUFFIXES)})"
        )
    problems, errors = read_manifest(path)
    return FiniteSuite(problems, errors)


def _from_plugin(plugin: Any, reference: str, path: str | None) -> GeneratedSuite | FiniteSuite:
    if isinstance(plugin, GeneratedSuite):
        return plugin
    if callable(plugin) and not isinstance(plugin, type):
        try:
            plugin = plugin(path) if path is not None else plugin()
        except TypeError as exc:
            raise SuiteError(f"suite plugin {reference!r} could not be called: {exc}") from None
        if isinstance(plugin, GeneratedSuite):
            return plugin
    if not isinstance(plugin, Iterable) or isinstance(plugin, str | bytes | dict):
        raise SuiteError(
            f"suite plugin {reference!r} gave {type(plugin).__name__}; expected a GeneratedSuite or an "
            "iterable of Problem (or Problem JSON)"
        )
    problems, errors = [], []
    for index, item in enumerate(plugin):
        where = f"{reference} item {index}"
        if isinstance(item, Problem):
            problems.append(item)
        elif isinstance(item, dict):
            try:
                problems.append(record_problem(item, where))
            except ValueError as exc:
                errors.append(str(exc))
        else:
            errors.append(f"{where}: a {type(item).__name__}, not a Problem or Problem JSON")
    return FiniteSuite(problems, errors)


def suite_problem_id(suite: str, problem_id: str) -> str:
    """A problem's id inside suite ``suite``: ``<suite>-<its own id>`` (a folder problem's ``folder-``
    prefix dropped; an id that already starts with ``<suite>-`` kept)."""
    if problem_id.startswith(f"{suite}-"):
        return problem_id
    return f"{suite}-{problem_id.removeprefix('folder-')}"


def _into_suite(spec: SuiteSpec, problems: list[Problem]) -> list[Problem]:
    renamed = []
    for problem in problems:
        changes: dict[str, Any] = {
            "problem_id": suite_problem_id(spec.name, problem.problem_id),
            "suite": spec.name,
            "meta": {**problem.meta, "suite_id": problem.problem_id},
        }
        if spec.harness is not None:
            changes["harness"] = list(spec.harness)
        renamed.append(replace(problem, **changes))
    return renamed


def generated_problems(
    suite: GeneratedSuite, spec: SuiteSpec, n: int, *, seed: int, difficulty: int, length: int
) -> list[Problem]:
    """``n`` problems of a generated suite, in the suite (its name, its id prefix, the spec's harness)."""
    problems = suite.generate(n, seed=seed, difficulty=difficulty, length=length)
    if spec.harness is None and all(p.suite == spec.name for p in problems):
        return problems  # the built-ins: already theirs
    return [
        replace(
            p,
            problem_id=suite_problem_id(spec.name, p.problem_id),
            suite=spec.name,
            harness=list(spec.harness) if spec.harness is not None else p.harness,
        )
        for p in problems
    ]
