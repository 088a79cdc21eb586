"""The built-in pytest grader of folder problems, and the counting both pytest-based graders share.

**Which tests count.** Only the hidden tests do, and only as the problem's files define them:
``hidden_test_ids`` parses every hidden test module (``test_*.py`` / ``*_test.py``) with ``ast``
and lists the tests pytest would collect from it with its default settings: module-level
``test*`` functions, ``test*`` methods of ``Test*`` classes without ``__init__`` (nested ones
too) and of ``unittest.TestCase`` subclasses. That list, fixed before any agent code runs, is the
total. A test passes when every reported instance of it passed (parametrized ids, ``test_f[1]``,
``test_f[2]``, are grouped under ``test_f``): a test the run never reported (its module failed to
import, the run died or timed out), a skipped or xfailed one, counts as failed; a test the
agent added never counts. Tests that exist only at run time (made in a loop, inherited from a
class in another module) are not seen by the count: write hidden tests as plain functions.

**The runner.** ``runner_source`` is a short program fed to ``<this interpreter> -I -B -`` on
stdin, so it lives outside the workspace and Python ignores the working folder and every PYTHON*
variable. Before any test runs it marks itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``: no
other process of its uid may read its memory, open its descriptors through ``/proc`` or trace it)
and closes its report descriptor on exec. The report is a file in a folder no sandboxed command
sees (the grading process opened it and passed the descriptor: ``Sandbox.run(pass_fds=...)``), so
no process the tests start, and nothing in any file system the agent's code reaches, can read,
rewrite or delete it. The runner writes a start line, adds a last-resort import
finder for the workspace (it serves a top-level module only after the standard library and
site-packages found none, and only to an import made by code that lives in the workspace: the real
pytest always wins over an agent's ``pytest.py`` or ``json.py``, and pytest's own probes for
optional modules never reach the agent's files) and runs ``pytest.main`` on the hidden test modules with plugin autoloading off
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), ``-p no:cacheprovider``, an empty configuration file outside
the workspace (``-c``), ``--rootdir`` the workspace and ``--import-mode=append``. Every test phase's
outcome becomes one JSON line of the report, carrying a random nonce that only the runner knows
(it came on stdin, is in no argument, variable or file), so a line from anywhere else is not
accepted. ``read_report`` counts, in the grading process, which never imports agent code.

**What this cannot stop.** Hidden tests that import the agent's code bring it into the runner's
own interpreter, and code running in a process can change anything in it: patch pytest's reports,
find the nonce, write the report itself. A grader that must hold against that runs no agent code
in the process that decides: checks.py probes (grading.py) or tests that start the agent's
program as a subprocess and compare its output (docs/security.md, examples/suites/out-of-process).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

REPORT_READ_BYTES = 16 << 20
"""Bytes of a report the grading process reads (RLIMIT_FSIZE bounds it anyway)."""
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py")
_PARAMS = re.compile(r"\[.*\]$", re.DOTALL)


def hidden_test_modules(hidden: Iterable[str]) -> list[str]:
    """The hidden files pytest collects tests from, sorted."""
    return sorted(
        rel
        for rel in hidden
        if any(fnmatch.fnmatchcase(PurePosixPath(rel).name, p) for p in TEST_FILE_PATTERNS)
    )


def hidden_test_ids(hidden: dict[str, str]) -> list[str]:
    """Node ids (``path::Class::test``, no parameters) of the tests the hidden modules define.
    Raises SyntaxError for a hidden module that does not parse."""
    ids: list[str] = []
    for rel in hidden_test_modules(hidden):
        tree = ast.parse(hidden[rel], filename=rel)
        ids.extend(f"{rel}::{name}" for name in _tests_in(tree.body))
    return ids


def _tests_in(body: list[ast.stmt], *, in_class: bool = False) -> list[str]:
    found = []
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            found.append(node.name)
        elif isinstance(node, ast.ClassDef) and _collected_class(node):
            found.extend(f"{node.name}::{name}" for name in _tests_in(node.body, in_class=True))
    return found


def _collected_class(node: ast.ClassDef) -> bool:
    if any(_base_name(base).endswith("TestCase") for base in node.bases):
        return True
    has_init = any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in node.body)
    return node.name.startswith("Test") and not has_init


def _base_name(base: ast.expr) -> str:
    return ast.unparse(base).rsplit(".", 1)[-1]


def test_of(node_id: str) -> str:
    """The test a reported node id belongs to: its parameters dropped."""
    return _PARAMS.sub("", node_id)


def score(expected: list[str], outcomes: dict[str, bool]) -> tuple[int, list[str]]:
    """(tests passed, verdict lines): a test passes when at least one instance was reported and
    every reported instance passed. ``outcomes``: node id (with parameters) -> passed."""
    grouped: dict[str, list[bool]] = {}
    for node_id, passed in outcomes.items():
        grouped.setdefault(test_of(node_id), []).append(passed)
    lines, passed = [], 0
    for test in expected:
        results = grouped.get(test)
        if results and all(results):
            passed += 1
            lines.append(f"PASS {test}")
        else:
            lines.append(f"FAIL {test}{'' if results else ' - not reported'}")
    return passed, lines


# ------------------------------------------------------------------------------- the runner

START = "start"
"""The report's first line: the runner's imports worked, no agent code has run yet."""

_RUNNER = """
import ctypes, importlib.machinery, json, os, sys

NONCE, WORKSPACE, _FD, CONFIG, MODULES = {nonce!r}, {workspace!r}, {report_fd!r}, {config!r}, {modules!r}
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
    raise SystemExit("gyre runner: prctl(PR_SET_DUMPABLE) failed: the report would be reachable")
os.set_inheritable(_FD, False)  # no process the tests start holds it


def _record(**fields):
    os.write(_FD, (json.dumps({{"nonce": NONCE, **fields}}) + "\\n").encode())


os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
with open(CONFIG, "w") as handle:
    handle.write("[pytest]\\n")
import pytest

_record(event={start!r})
os.chdir(WORKSPACE)
_SKIPPED = ("<frozen ", os.path.join("importlib", "__init__.py"))


# a top-level module in the workspace, after the standard library and site-packages failed, and
# only for an import made by code that lives in the workspace
class _FromWorkspace:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is not None:
            return None
        frame = sys._getframe(1)
        while frame is not None and (
            frame.f_code.co_filename.startswith(_SKIPPED[0]) or frame.f_code.co_filename.endswith(_SKIPPED[1])
        ):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(WORKSPACE + os.sep):
            return None
        return importlib.machinery.PathFinder.find_spec(name, [WORKSPACE])


sys.meta_path.append(_FromWorkspace)


class _Recorder:
    def pytest_runtest_logreport(self, report):
        passed = report.passed and not hasattr(report, "wasxfail")
        if report.when == "call" or not passed:
            _record(id=report.nodeid, phase=report.when, passed=passed)

    def pytest_collectreport(self, report):
        if report.failed:
            _record(event="collect-error", where=report.nodeid)


code = pytest.main(
    [*MODULES, "-q", "-p", "no:cacheprovider", "-c", CONFIG, "--rootdir", WORKSPACE,
     "--import-mode=append", "-o", "console_output_style=classic"],
    plugins=[_Recorder()],
)
_record(event="done", exit=int(code))
"""


def runner_source(*, nonce: str, workspace: str, report_fd: int, config: str, modules: list[str]) -> str:
    """The runner program (module docstring): fed on stdin to ``python -I -B -``, with the report
    open as ``report_fd``."""
    return _RUNNER.format(
        nonce=nonce, workspace=workspace, report_fd=report_fd, config=config, modules=modules, start=START
    )


def read_report(path: Path, nonce: str) -> tuple[bool, dict[str, bool], list[str]]:
    """(whether the runner started, node id -> passed, notes) from a runner's report. Lines without
    the nonce are ignored (and counted in the notes); a node id is passed only if every phase
    reported for it passed."""
    if not path.is_file():
        return False, {}, ["no report"]
    with open(path, "rb") as handle:
        data = handle.read(REPORT_READ_BYTES)
    started, outcomes, forged, notes = False, {}, 0, []
    for raw in data.splitlines():
        try:
            line = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            forged += 1
            continue
        if not isinstance(line, dict) or line.get("nonce") != nonce:
            forged += 1
            continue
        if line.get("event") == START:
            started = True
        elif line.get("event") == "collect-error":
            notes.append(f"collection error in {str(line.get('where'))[:200]}")
        elif isinstance(line.get("id"), str):
            ok = line.get("passed") is True
            outcomes[line["id"]] = outcomes.get(line["id"], True) and ok
    if forged:
        notes.append(f"ignored {forged} report lines without the runner's nonce")
    return started, outcomes, notes


# --------------------------------------------------------------------------------- JUnit XML


def junit_outcomes(path: Path, expected: list[str]) -> tuple[dict[str, bool], list[str]]:
    """node id -> passed from a JUnit XML report (pytest ``--junitxml``), for the ``expected`` tests
    only: a testcase's ``classname`` + ``name`` is matched to ``path::Class::test`` (pytest writes
    ``tests.test_calc.TestX`` and ``test_y[1]``). Unreadable XML gives no outcomes."""
    if not path.is_file():
        return {}, ["no JUnit report"]
    try:
        with open(path, "rb") as handle:
            root = ET.fromstring(handle.read(REPORT_READ_BYTES))
    except ET.ParseError as exc:
        return {}, [f"JUnit report is not XML: {exc}"]
    wanted = {_junit_key(test): test for test in expected}
    outcomes: dict[str, bool] = {}
    for case in root.iter("testcase"):
        name = case.get("name") or ""
        key = (case.get("classname") or "", test_of(name))
        if key not in wanted:
            continue
        node_id = wanted[key] + name[len(test_of(name)) :]
        failed = any(child.tag in ("failure", "error", "skipped") for child in case)
        outcomes[node_id] = outcomes.get(node_id, True) and not failed
    return outcomes, []


def _junit_key(test: str) -> tuple[str, str]:
    module, *classes, name = test.split("::")
    dotted = module.removesuffix(".py").replace("/", ".")
    return ".".join([dotted, *classes]), name
