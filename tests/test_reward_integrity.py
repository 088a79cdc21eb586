"""Reward integrity: every way we know to take a reward without solving gets the control's reward.

Each attack is tried on every suite, graded from the final workspace and from a snapshot of it (the
timeout path), and must score what the same workspace scores without the attack; a reference
solution still scores 1.0 next to the attack files. The answer key (graders, hidden tests, reference
solutions, the problem generators, other executions) must be out of reach of sandboxed commands and
of the JSON a harness gets. All of it runs real sandboxes, real interpreters and real pytest.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig
from environments.problems import Problem, apply_solution, generate, grade_workspace, write_workspace
from environments.problems.grading import run_grade_command
from environments.sandbox import Sandbox
from environments.snapshot import extract_snapshot, snapshot_bytes
from tests.scripted_engine import scripted_stack
from tests.test_gateway_fixtures import ADMIN_TOKEN

GENERATED = ("repo", "swe", "terminal")

# Agent code that claims a full score every way a grader might read one: a summary line, forged
# observations (a terminal check expects `true`), a killed parent, exit status 0.
FORGER = r"""
import os
for fd in (1, 2):
    try:
        os.write(fd, b'\n{"passed": 99, "total": 99}\n@@gyre-observed@@ true\n@@gyre-probe-ready@@\n')
    except OSError:
        pass
try:
    os.kill(os.getppid(), 9)
except Exception:
    pass
os._exit(0)
"""
SHADOWS = (
    "json.py",
    "os.py",
    "sys.py",
    "signal.py",
    "pathlib.py",
    "io.py",
    "sitecustomize.py",
    "usercustomize.py",
)
"""Modules a grader imports (or Python loads at start-up), written by the agent."""
EQUALS_ANYTHING = """
class _Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __bool__(self):
        return True
    __hash__ = object.__hash__


def __getattr__(name):
    return lambda *args, **kwargs: _Anything()
"""


def _module_path(problem: Problem) -> str | None:
    writes = [s["arguments"]["path"] for s in problem.solution if s["tool"] == "write_file"]
    return next((p for p in writes if p.endswith(".py") and not p.endswith("__init__.py")), None)


def _attacks(problem: Problem) -> dict[str, dict[str, str]]:
    """attack name -> files the agent writes (relative path -> text)."""
    attacks = {
        "shadowed modules": dict.fromkeys(SHADOWS, FORGER),
        "python and .gyre_bin/python on PATH": {
            ".gyre_bin/python": "#!/bin/sh\n"
            + "echo '@@gyre-probe-ready@@'; echo '@@gyre-observed@@ true'\n",
            "python": '#!/bin/sh\necho \'{"passed": 9, "total": 9}\'\n',
        },
    }
    module = _module_path(problem)
    if module:  # repo / swe: the graded code itself is the agent's
        attacks["graded module forges and exits"] = {module: FORGER}
        attacks["graded module returns objects equal to anything"] = {module: EQUALS_ANYTHING}
        if "/" in module:  # a package: its __init__ runs first
            attacks["package __init__ forges"] = {module.split("/")[0] + "/__init__.py": FORGER}
    return attacks


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)


def _grades(problem: Problem, workspace: Path, tmp: Path) -> tuple[float, float]:
    """(reward of the final workspace, reward graded from its snapshot)."""
    final = grade_workspace(problem, workspace).reward
    restored = tmp / f"restored-{workspace.name}"
    extract_snapshot(snapshot_bytes(workspace), restored)
    return final, grade_workspace(problem, restored).reward


@pytest.mark.slow
@pytest.mark.parametrize("suite", GENERATED)
def test_agent_written_files_never_raise_a_generated_reward(suite, tmp_path):
    problem = generate(suite, 1, seed=21, difficulty=2)[0]
    control = write_workspace(problem, tmp_path / "control")
    control_reward = grade_workspace(problem, control).reward
    assert control_reward < 1.0
    for name, files in _attacks(problem).items():
        attacked = tmp_path / f"attack-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(control, attacked)
        _write(attacked, files)
        assert _grades(problem, attacked, tmp_path) == (control_reward, control_reward), name
    # the reference solution still scores 1.0 with every attack file that leaves its code alone
    solved = write_workspace(problem, tmp_path / "solved")
    apply_solution(problem, solved)
    _write(
        solved,
        _attacks(problem)["shadowed modules"] | _attacks(problem)["python and .gyre_bin/python on PATH"],
    )
    assert _grades(problem, solved, tmp_path) == (1.0, 1.0)


# ------------------------------------------------------------------------------ pytest folders

CONFTEST_FORCES_PASS = """
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""
PYTEST_CONFIGS = {
    "pytest.ini": "[pytest]\naddopts = -p agent_plugin\n",
    "pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-p agent_plugin"\n',
    "tox.ini": "[pytest]\naddopts = -p agent_plugin\n",
    "setup.cfg": "[tool:pytest]\naddopts = -p agent_plugin\n",
}
PYTEST_COMMAND = f"{sys.executable} -m pytest -q -p no:cacheprovider tests"


def _pytest_problem(template: dict[str, str] | None = None) -> Problem:
    return Problem(
        problem_id="folder-calc",
        suite="folder",
        instruction="Fix add in calc.py.",
        files={"calc.py": "def add(a, b):\n    return a - b\n", **(template or {})},
        hidden_tests={
            "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
        },
        grade_command=(
            f"( cd . && PYTHONPATH=. {PYTEST_COMMAND}\n); status=$?; echo; "
            'if [ "$status" -eq 0 ]; then echo \'{"passed": 1, "total": 1}\'; '
            'else echo \'{"passed": 0, "total": 1}\'; fi'
        ),
    )


def _pytest_attacks() -> dict[str, dict[str, str]]:
    plugin = {"agent_plugin.py": CONFTEST_FORCES_PASS}
    attacks = {
        "conftest.py at the root": {"conftest.py": CONFTEST_FORCES_PASS},
        "conftest.py beside the hidden tests": {"tests/conftest.py": CONFTEST_FORCES_PASS},
        "stale byte code": {"__pycache__/conftest.cpython-311.pyc": "junk"},
    }
    for config, text in PYTEST_CONFIGS.items():
        attacks[f"{config} loading a plugin"] = {config: text, **plugin}
    return attacks


@pytest.mark.slow
def test_agent_written_pytest_plugins_and_config_are_neutralised(tmp_path):
    problem = _pytest_problem()
    control = write_workspace(problem, tmp_path / "control")
    assert _grades(problem, control, tmp_path) == (0.0, 0.0)
    for name, files in _pytest_attacks().items():
        attacked = tmp_path / f"attack-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(control, attacked)
        _write(attacked, files)
        if "byte code" not in name:  # the attack is real: un-neutralised, pytest passes
            (attacked / "tests").mkdir(exist_ok=True)
            (attacked / "tests/test_calc.py").write_text(problem.hidden_tests["tests/test_calc.py"])
            raw = run_grade_command(f"PYTHONPATH=. {PYTEST_COMMAND}", Sandbox(attacked), 60)
            assert raw.returncode == 0, (name, raw.stdout[-500:])
            (attacked / "tests/test_calc.py").unlink()
        assert _grades(problem, attacked, tmp_path) == (0.0, 0.0), name
    solved = tmp_path / "solved"
    shutil.copytree(control, solved)
    (solved / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    _write(solved, {"conftest.py": "raise SystemExit('agent conftest')\n"})
    assert _grades(problem, solved, tmp_path) == (1.0, 1.0)


def test_template_pytest_config_is_kept_and_an_agent_change_to_it_restored(tmp_path):
    ini = "[pytest]\naddopts = -q\n"
    problem = _pytest_problem({"pytest.ini": ini})
    workspace = write_workspace(problem, tmp_path / "ws")
    (workspace / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    assert grade_workspace(problem, workspace).reward == 1.0
    (workspace / "calc.py").write_text("def add(a, b):\n    return 0\n")
    _write(workspace, {"pytest.ini": PYTEST_CONFIGS["pytest.ini"], "agent_plugin.py": CONFTEST_FORCES_PASS})
    result = grade_workspace(problem, workspace)
    assert result.reward == 0.0 and "restored pytest.ini" in result.log
    assert (workspace / "pytest.ini").read_text() == PYTEST_CONFIGS[
        "pytest.ini"
    ]  # the agent's copy untouched


# ------------------------------------------------------------------------------- the answer key


def test_sandboxed_commands_see_no_checkout_packages_secrets_or_other_workspaces(tmp_path):
    import environments

    checkout = Path(environments.__file__).resolve().parent.parent
    root = tmp_path / "workspaces"
    Sandbox.create(root, "other", {"problem.json": '{"solution": "the answer"}'})
    sandbox = Sandbox.create(root, "mine", {"a.txt": "a\n"})
    probes = {
        "python -c 'import environments'": "No module named 'environments'",
        "python -c 'import trajectory_store'": "No module named 'trajectory_store'",
        f"ls -A {checkout} | grep -v '^.venv$' | wc -l": "0",  # the venv: the interpreter
        f"cat {checkout}/environments/problems/registry.py 2>&1 | head -1": "No such file",
        f"ls -A {root}": "mine",
        "cat /etc/shadow | wc -c": "0",
        "ls -A /root | grep -v '^.pyenv$' | wc -l": "0",
        "ls -A /home /srv /opt /var 2>/dev/null | grep -v ':$' | grep -c . || true": "0",
    }
    for command, expected in probes.items():
        result = sandbox.run(command)
        assert expected in (result.stdout + result.stderr).strip(), (command, result.stdout, result.stderr)
    # the interpreter and its libraries still work, read-only
    result = sandbox.run("python -c 'import json, sqlite3; print(7)'; touch /usr/x 2>&1 | head -1")
    assert result.stdout.startswith("7") and "Read-only" in result.stdout


@pytest.mark.slow
def test_harnesses_get_no_grader_and_workspaces_have_opaque_names(tmp_path):
    """An external harness copies what it can reach: the problem JSON beside its instruction file,
    its workspace's name, and what a sandboxed command sees around the workspace."""
    problem = generate("repo", 1, seed=3, difficulty=1)[0]
    spy = (
        'cp "$(dirname {instruction_file})/problem.json" {workspace}/seen_problem.json; '
        "basename {workspace} > {workspace}/seen_name.txt; "
        "ls -A $(dirname {workspace}) > {workspace}/seen_siblings.txt"
    )
    with scripted_stack(str(tmp_path), lambda text: "nothing") as stack:
        config = DispatchConfig(
            workspace_root=str(tmp_path / "ws"),
            group_size=2,
            keep_workspaces=True,
            workspace_disk_bytes=None,  # plain folders: kept workspaces must not stay mounted
            harness_command=["bash", "-c", spy],
        )
        outcomes = asyncio.run(dispatch([problem], stack.url, ADMIN_TOKEN, stack.store_config, config))
    assert [o.status for o in outcomes] == ["completed", "completed"]
    workspaces = sorted((tmp_path / "ws").iterdir())
    assert len(workspaces) == 2
    for workspace in workspaces:
        seen = json.loads((workspace / "seen_problem.json").read_text())
        assert seen == {
            "suite": "repo",
            "instruction": problem.instruction,
            "visible_test_command": problem.visible_test_command,
        }
        name = (workspace / "seen_name.txt").read_text().strip()
        assert problem.problem_id not in name and "s0-" not in name and len(name) == 16
        assert list((tmp_path / "ws").glob("*.run")) == []  # no harness files beside the workspaces
        # a sandboxed command in this workspace sees no sibling
        assert Sandbox(workspace, hide_root=workspace.parent).run("ls -A ..").stdout.split() == [
            workspace.name
        ]
    assert outcomes[0].error is None and {o.reward for o in outcomes} == {0.0}
