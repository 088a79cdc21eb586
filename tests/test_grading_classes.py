"""Reward integrity by class (issue 49): the report out of reach, the grading copy free of
configuration, no module in place of a hidden one, and a grade for every workspace.

The problem is the project's own subprocess-style example (examples/suites/out-of-process/csv-total:
its hidden tests run the agent's ``total.py`` as a child process and import nothing of the agent's),
graded by every pytest-based grader kind: the built-in runner, and grade commands reporting JUnit
XML, a JSON summary or an exit code. Its unsolved workspace scores 0; no attack may raise that, from
the final workspace or from its snapshot (the timeout path). Each configuration attack is shown to
be real first: graded without the neutralisation, pytest passes. Real sandboxes, real pytest.
"""

from __future__ import annotations

import ast
import inspect
import shutil
import site
import sysconfig
from pathlib import Path

import pytest

from bench.exploit_cases import CONFIGS, child_forger, claim_everything, extension_module
from environments.execution_grade import grade_final, grade_snapshot
from environments.problems import Problem, apply_solution, grade_workspace, load_folder, write_workspace
from environments.problems.grading import run_grade_command
from environments.problems.grading_copy import NEUTRALISED_NAMES, PATH_MARKERS, PYTEST_CONFIG_NAMES
from environments.sandbox import Sandbox
from trajectory_store.snapshots import SnapshotStore
from trajectory_store.storage import Store, StoreConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples/suites/out-of-process"
TESTS = ["test_sums_a_column", "test_picks_the_named_column", "test_missing_column_exits_2"]
IN_PROCESS = claim_everything("test_total", TESTS)
"""Code that, once it runs in the process that grades, claims every test every way a grader reads one."""
PLUGIN = {"agent_plugin.py": IN_PROCESS}
STEAL_THE_REPORT = child_forger("test_total", TESTS)
"""The agent's program, run by the hidden tests as a child: it goes after every report it can reach."""
PYTEST = "python -m pytest -q -p no:cacheprovider"
COMMANDS = {  # grade commands as users write them, the workspace on the module path for their code
    "junit": f"PYTHONPATH=. {PYTEST} tests --junitxml=$GYRE_REPORT",
    "exit_code": f"PYTHONPATH=. {PYTEST} tests",
    "json": (
        f"PYTHONPATH=. {PYTEST} tests > .out 2>&1\n"
        "python -c \"import re; t = open('.out').read().splitlines()[-1]; "
        "p = sum(map(int, re.findall(r'(\\d+) passed', t))); "
        "f = sum(map(int, re.findall(r'(\\d+) (?:failed|error)', t))); "
        'print({\\"passed\\": p, \\"total\\": max(1, p + f)})" | tr "\'" \'"\''
    ),
}
KINDS = ("pytest", *COMMANDS)


def _csv_total() -> Problem:
    return {p.problem_id: p for p in load_folder(EXAMPLES, strict=True)}["folder-csv-total"]


def _as_kind(problem: Problem, kind: str, *, hidden_at_root: bool = False) -> Problem:
    fields = problem.to_json()
    if hidden_at_root:  # the hidden module at the workspace root, its WORKSPACE one folder up
        hidden = {
            "test_total.py": fields["hidden_tests"]["tests/test_total.py"].replace("parents[1]", "parent")
        }
        fields["hidden_tests"] = hidden
    if kind != "pytest":
        target = "test_total.py" if hidden_at_root else "tests"
        fields |= {
            "grader": None,
            "grade_output": kind,
            "grade_command": COMMANDS[kind].replace("tests", target),
        }
    return Problem(**fields)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _both(problem: Problem, workspace: Path, tmp: Path) -> tuple[float, float]:
    """(reward of the final workspace, reward from its snapshot), as the dispatcher grades them."""
    final = grade_final(problem, workspace, timeout_s=60, retries=0)
    snapshots = SnapshotStore(Store(StoreConfig(data_root=str(tmp / "data"))))
    stored = grade_snapshot(
        problem, workspace, snapshots, 0, f"s0-p-g{len(list(tmp.iterdir()))}", timeout_s=60, retries=0
    )
    assert not final.eval_failed and not stored.eval_failed, (final.error, stored.error)
    return final.reward, stored.reward


# ------------------------------------------------------------------------ 1. the report out of reach


@pytest.mark.parametrize("kind", ["pytest", "exit_code"])
def test_a_child_process_of_the_tests_cannot_reach_the_report(kind, tmp_path):
    """The issue's first case: on the built-in grader the child read the nonce from the report in the
    grading folder and rewrote it (1.0 where pytest printed FFF)."""
    problem = _as_kind(_csv_total(), kind)
    workspace = write_workspace(problem, tmp_path / "ws")
    assert grade_workspace(problem, workspace).reward == 0.0
    _write(workspace, {"total.py": STEAL_THE_REPORT})
    result = grade_workspace(problem, workspace)
    assert result.reward == 0.0, result.log
    assert _both(problem, workspace, tmp_path) == (0.0, 0.0)
    apply_solution(problem, workspace)
    assert grade_workspace(problem, workspace).reward == 1.0


# --------------------------------------------------------- 2. configuration and package markers


def _literals(module) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_the_neutralised_names_are_the_installed_tools_own():
    """Read from the pinned pytest's and Python's own sources: a version that learns a new
    configuration file fails here until grading_copy.py names it."""
    import _pytest.config
    import _pytest.config.findpaths

    files = {
        name
        for name in _literals(_pytest.config.findpaths) | _literals(_pytest.config)
        if name.endswith((".ini", ".toml", ".cfg", ".py")) and name.lstrip(".").count(".") == 1
    }
    files.discard("__main__.py")  # the name of pytest's own program (argv[0]), never a file it reads
    assert files <= NEUTRALISED_NAMES | set(PATH_MARKERS), files - NEUTRALISED_NAMES - set(PATH_MARKERS)
    assert set(PYTEST_CONFIG_NAMES) <= files
    startup = {f"{name}.py" for name in ("sitecustomize", "usercustomize") if name in _literals(site)}
    assert startup and startup <= NEUTRALISED_NAMES


def _extension_shadow(tmp_path: Path, name: str) -> dict[str, bytes]:
    """A real extension module ``name`` whose import claims every test (what an agent can build with
    the compiler the sandbox shows)."""
    return {f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}": extension_module(name, IN_PROCESS, tmp_path)}


def _attacks(tmp_path: Path, hidden_at_root: bool) -> dict[str, dict[str, str | bytes]]:
    if hidden_at_root:
        return {
            "a package named like the hidden module": {"test_total/__init__.py": IN_PROCESS},
            "an extension module named like the hidden one": _extension_shadow(tmp_path, "test_total"),
            "a root __init__.py": {"__init__.py": IN_PROCESS},
        }
    attacks: dict[str, dict[str, str | bytes]] = {
        f"{name} loading a plugin": {name: text, **PLUGIN} for name, text in CONFIGS.items()
    }
    attacks["a root __init__.py"] = {"__init__.py": IN_PROCESS}
    attacks["conftest.py"] = {"conftest.py": IN_PROCESS}
    attacks["a module named like the hidden one"] = {"test_total.py": IN_PROCESS}
    attacks["a module named like pytest"] = {"pytest.py": IN_PROCESS}
    attacks["a module named like a standard one"] = {"re.py": "import os\nos._exit(0)\n"}
    attacks["a sitecustomize package"] = {"sitecustomize/__init__.py": "import os\nos._exit(0)\n"}
    return attacks


def _place(root: Path, files: dict[str, str | bytes]) -> None:
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (root / rel).write_bytes(content)
        else:
            (root / rel).write_text(content)


def _raw_passes(problem: Problem, attacked: Path, tmp: Path) -> bool:
    """Whether the attack is real: the workspace with the hidden files, graded by the same pytest
    command without any neutralisation, passes."""
    raw = tmp / f"raw-{attacked.name}"
    shutil.copytree(attacked, raw)
    _place(raw, dict(problem.hidden_tests))
    command = COMMANDS["exit_code"].replace("tests", " ".join(sorted(problem.hidden_tests)))
    return run_grade_command(command, Sandbox(raw), 60).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("hidden_at_root", [False, True], ids=["tests-folder", "hidden-at-root"])
def test_configuration_package_markers_and_shadows_never_raise_a_reward(hidden_at_root, tmp_path):
    base = _csv_total()
    attacks = _attacks(tmp_path, hidden_at_root)
    control = write_workspace(base, tmp_path / "control")
    for name, files in attacks.items():
        attacked = tmp_path / f"attack-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(control, attacked)
        _place(attacked, files)
        if not name.startswith(("a module named", "a package named", "an extension")):
            assert _raw_passes(
                _as_kind(base, "exit_code", hidden_at_root=hidden_at_root), attacked, tmp_path
            ), name
        for kind in KINDS:
            problem = _as_kind(base, kind, hidden_at_root=hidden_at_root)
            assert _both(problem, attacked, tmp_path) == (0.0, 0.0), (name, kind)
    solved = write_workspace(base, tmp_path / "solved")
    apply_solution(base, solved)
    _place(solved, {"pytest.toml": CONFIGS["pytest.toml"], "__init__.py": "raise SystemExit(3)\n", **PLUGIN})
    for kind in KINDS:
        assert grade_workspace(_as_kind(base, kind, hidden_at_root=hidden_at_root), solved).reward == 1.0, (
            kind
        )
