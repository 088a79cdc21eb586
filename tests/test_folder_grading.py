"""Folder problems' graders against an agent that tries to take a reward without solving.

One partially-correct workspace (1 of 4 functions right: 0.25) is the control; every exploit is
applied to a copy of it and graded from the final workspace and from its snapshot (store_workspace
-> sandbox_from_stored, as the runner grades a timeout), by the built-in pytest grader and by the
out-of-process checks.py grader. No exploit may score more than the control, and none may make the
grader fail (GraderError) or the snapshot unusable. Real sandboxes, real pytest, no mocks.

Known limit, recorded here (docs/security.md): code under test runs in the built-in pytest grader's
own interpreter, so an agent module that patches pytest when it is imported
(``IMPORT_TIME_PATCH``) scores 1.0 there (0.25 -> 1.0, on both paths); the checks.py grader, which
judges outside the sandbox, keeps it at the control's 0.25.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from environments.problems import apply_solution, grade_workspace, load_folder, write_workspace
from environments.problems.folder import ProblemFolderError, load_problem
from environments.problems.pytest_grader import hidden_test_ids, score
from environments.snapshot import MAX_EXTRACT_BYTES, MAX_EXTRACT_MEMBERS
from environments.snapshot_rows import TRUNCATED_MARKER, sandbox_from_stored, store_workspace
from trajectory_store.snapshots import SnapshotStore
from trajectory_store.storage import Store, StoreConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples/suites/out-of-process"
FUNCTIONS = ("add", "sub", "mul", "div")
TEMPLATE = "".join(f"def {name}(a, b):\n    return 0\n\n\n" for name in FUNCTIONS)
PARTIAL = TEMPLATE.replace("return 0", "return a + b", 1)
SOLVED = PARTIAL.replace("return 0", "return a - b", 1).replace("return 0", "return a * b", 1)
SOLVED = SOLVED.replace("return 0", "return a // b", 1)
CASES = {"add": "(2, 3) == 5", "sub": "(5, 3) == 2", "mul": "(2, 3) == 6", "div": "(6, 3) == 2"}
TESTS = "from calc import add, sub, mul, div\n" + "".join(
    f"\n\ndef test_{name}():\n    assert {name}{case}\n" for name, case in CASES.items()
)
CHECKS = "import calc\n" + "".join(
    f"\n\ndef check_{name}():\n    expect_equal(calc.{name}{case.replace(' == ', ', ')}, '{name}')\n"
    for name, case in CASES.items()
)

FORCE_PASS = """
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
"""
FORGE = (
    "import os\n"
    'os.write(1, b\'\\n{"passed": 4, "total": 4}\\n4 passed in 0.01s\\n@@gyre-observed@@ 5\\n\')\n'
    "os._exit(0)\n"
)
IMPORT_TIME_PATCH = """
import _pytest.reports as _reports
_original = _reports.TestReport.from_item_and_call.__func__


def _forced(cls, item, call):
    report = _original(cls, item, call)
    report.outcome, report.longrepr = "passed", None
    return report


_reports.TestReport.from_item_and_call = classmethod(_forced)
"""
FAKE_JSON = (
    'def dumps(*args, **kwargs):\n    return \'{"passed": 4, "total": 4}\'\n\n\n'
    "def loads(*args, **kwargs):\n    return {'passed': 4, 'total': 4}\n"
)
CHILD_FORGES_REPORT = """
import json, os, subprocess, sys, glob
lines = [json.dumps({"nonce": "guess", "id": f"tests/test_calc.py::test_{n}", "passed": True})
         for n in ("add", "sub", "mul", "div")]
for report in glob.glob(os.path.join(os.path.dirname(os.getcwd()), "*report*")):
    subprocess.run([sys.executable, "-c", f"open({report!r}, 'a').write({chr(10).join(lines)!r})"])
"""

EXPLOITS: dict[str, dict[str, str] | str] = {
    "1 pytest.py in the workspace root": {"pytest.py": FORGE},
    "2 dist-info with a pytest11 entry point": {
        "agent_plugin-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: agent-plugin\nVersion: 1.0\n",
        "agent_plugin-1.0.dist-info/entry_points.txt": "[pytest11]\nagent = agent_plugin\n",
        "agent_plugin.py": FORCE_PASS,
    },
    "3 extra passing tests under tests/": {
        "tests/test_extra.py": "import pytest\n\n\n@pytest.mark.parametrize('i', range(100))\ndef test_x(i):\n    pass\n"
    },
    "4 json.py (json patching)": {"json.py": FAKE_JSON},
    "5 os._exit(0) at import (fake exit)": {"calc.py": "import os\nos._exit(0)\n" + PARTIAL},
    "5 fake summary printed at import": {"calc.py": FORGE + PARTIAL},
    "6 import-time patching of pytest": {"calc.py": IMPORT_TIME_PATCH + PARTIAL},
    "7 a FIFO": "fifo",
    "8 hard links to one 16 MiB file": "bomb",
    "conftest.py hook at the root": {"conftest.py": FORCE_PASS},
    "conftest.py hook beside the hidden tests": {"tests/conftest.py": FORCE_PASS},
    "pytest.ini loading a plugin": {
        "pytest.ini": "[pytest]\naddopts = -p agent_plugin\n",
        "agent_plugin.py": FORCE_PASS,
    },
    "shadowed modules": {name: FORGE for name in ("os.py", "re.py", "sitecustomize.py", "msvcrt.py")},
    "test module named like the hidden one": {"test_calc.py": IMPORT_TIME_PATCH},
    "a child process forges report lines": {"calc.py": CHILD_FORGES_REPORT + PARTIAL},
}
BOMB_LINKS = 20
"""20 links of 16 MiB: 336 MiB, past the grading copy's 256 MiB (the snapshot gets a 128 MiB limit)."""
SNAPSHOT_TEST_BYTES = 128 << 20


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _apply(workspace: Path, exploit: dict[str, str] | str) -> None:
    if exploit == "fifo":
        os.mkfifo(workspace / "calc_input")
    elif exploit == "bomb":
        with open(workspace / "big.bin", "wb") as handle:
            handle.truncate(16 << 20)
        for index in range(BOMB_LINKS):
            os.link(workspace / "big.bin", workspace / f"link{index}.bin")
    else:
        _write(workspace, exploit)


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    """The calc problem graded by the built-in pytest grader and by checks.py."""
    root = tmp_path_factory.mktemp("suite")
    common = {"instruction.md": "Fix calc.py.\n", "workspace/calc.py": TEMPLATE, "solution/calc.py": SOLVED}
    _write(root / "pytest", {**common, "tests/test_calc.py": TESTS})
    _write(root / "checks", {**common, "checks.py": CHECKS})
    loaded = {p.problem_id.removeprefix("folder-"): p for p in load_folder(root, strict=True)}
    assert loaded["pytest"].grader == "pytest" and len(loaded["checks"].checks) == 4
    return loaded


def _grades(problem, workspace: Path, tmp: Path, max_bytes: int = MAX_EXTRACT_BYTES) -> tuple[float, float]:
    """(reward of the final workspace, reward graded from its stored snapshot)."""
    final = grade_workspace(problem, workspace).reward
    snapshots = SnapshotStore(Store(StoreConfig(data_root=str(tmp / "data"))))
    uri = store_workspace(
        snapshots, 0, f"s0-p-g{secrets.token_hex(4)}", workspace, problem_id=problem.problem_id,
        template_files=problem.files, max_bytes=max_bytes,
    )  # fmt: skip
    fresh = Path(tempfile.mkdtemp(dir=tmp))
    try:
        restored = sandbox_from_stored(snapshots, uri, fresh, secrets.token_hex(8), max_bytes=max_bytes)
        return final, grade_workspace(problem, restored.workspace).reward
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


@pytest.mark.parametrize("kind", ["pytest", "checks"])
def test_no_exploit_beats_its_control(kind, problems, tmp_path):
    problem = problems[kind]
    control = write_workspace(problem, tmp_path / "control")
    (control / "calc.py").write_text(PARTIAL)
    assert _grades(problem, control, tmp_path) == (0.25, 0.25)
    scores = {}
    for name, exploit in EXPLOITS.items():
        attacked = tmp_path / f"attack-{len(scores)}"
        shutil.copytree(control, attacked)
        _apply(attacked, exploit)
        limit = SNAPSHOT_TEST_BYTES if exploit == "bomb" else MAX_EXTRACT_BYTES
        scores[name] = _grades(problem, attacked, tmp_path, limit)
        shutil.rmtree(attacked)
    beaten = {
        name: got
        for name, got in scores.items()
        if max(got) > 0.25 and not (kind == "pytest" and name.startswith("6 "))
    }
    assert beaten == {}, scores
    if kind == "pytest":  # the known limit of an in-process grader (module docstring)
        assert scores["6 import-time patching of pytest"] == (1.0, 1.0)


@pytest.mark.parametrize("kind", ["pytest", "checks"])
def test_reference_solution_scores_one_beside_attack_files(kind, problems, tmp_path):
    problem = problems[kind]
    assert [step["tool"] for step in problem.solution] == ["write_file"]
    untouched = write_workspace(problem, tmp_path / "untouched")
    assert grade_workspace(problem, untouched).reward == 0.0
    solved = write_workspace(problem, tmp_path / "solved")
    apply_solution(problem, solved)
    for name in (
        "1 pytest.py in the workspace root",
        "4 json.py (json patching)",
        "conftest.py hook at the root",
    ):
        _write(solved, EXPLOITS[name])
    os.mkfifo(solved / "pipe")
    assert _grades(problem, solved, tmp_path) == (1.0, 1.0)


def test_snapshot_of_a_hard_link_bomb_is_truncated_and_still_restores(problems, tmp_path):
    """The runner's defaults: what store_workspace keeps is what sandbox_from_stored accepts."""
    defaults = (store_workspace.__kwdefaults__["max_bytes"], store_workspace.__kwdefaults__["max_members"])
    assert defaults == (MAX_EXTRACT_BYTES, MAX_EXTRACT_MEMBERS)
    assert sandbox_from_stored.__defaults__[-2:] == (MAX_EXTRACT_BYTES, MAX_EXTRACT_MEMBERS)
    workspace = write_workspace(problems["pytest"], tmp_path / "ws")
    _apply(workspace, "bomb")
    snapshots = SnapshotStore(Store(StoreConfig(data_root=str(tmp_path / "data"))))
    uri = store_workspace(snapshots, 0, "s0-p-g0", workspace, problem_id="p", max_bytes=SNAPSHOT_TEST_BYTES)
    restored = sandbox_from_stored(snapshots, uri, tmp_path / "fresh", "r", max_bytes=SNAPSHOT_TEST_BYTES)
    marker = (restored.workspace / TRUNCATED_MARKER).read_text()
    assert marker.startswith("14 paths left out") and "link9.bin" in marker
    assert (restored.workspace / "calc.py").read_text() == TEMPLATE
    result = grade_workspace(problems["pytest"], workspace)
    assert result.reward == 0.0 and "used up" in result.log


def test_subprocess_style_tests_import_no_agent_code(tmp_path):
    """The example suite: both problems score 1.0 solved and 0.0 untouched; agent modules named like
    what pytest or the standard library import optionally (msvcrt, org) never load in the runner."""
    problems = {p.problem_id: p for p in load_folder(EXAMPLES, strict=True)}
    assert problems["folder-csv-total"].grader == "pytest"
    assert [s["tool"] for s in problems["folder-csv-total"].solution] == ["run"]
    for problem in problems.values():
        workspace = write_workspace(problem, tmp_path / problem.problem_id)
        assert grade_workspace(problem, workspace).reward == 0.0
        _write(workspace, {"msvcrt.py": IMPORT_TIME_PATCH, "org/__init__.py": IMPORT_TIME_PATCH})
        _write(workspace, {"pytest.py": FORGE, "json.py": FAKE_JSON})
        assert _grades(problem, workspace, tmp_path) == (0.0, 0.0), problem.problem_id
        apply_solution(problem, workspace)
        assert grade_workspace(problem, workspace).reward == 1.0, problem.problem_id


def test_junit_command_grader_counts_hidden_tests_only(tmp_path):
    command = "python -m pytest -q -p no:cacheprovider -o pythonpath=. tests --junitxml=$GYRE_REPORT"
    _write(
        tmp_path / "suite/calc",
        {
            "instruction.md": "Fix calc.py.\n",
            "workspace/calc.py": PARTIAL,
            "tests/test_calc.py": TESTS,
            "problem.toml": f'grade = "{command}"\ngrade_output = "junit"\n',
        },
    )
    problem = load_problem(tmp_path / "suite/calc")
    workspace = write_workspace(problem, tmp_path / "ws")
    _apply(workspace, EXPLOITS["3 extra passing tests under tests/"])
    assert grade_workspace(problem, workspace).reward == 0.25
    _apply(workspace, EXPLOITS["5 os._exit(0) at import (fake exit)"])  # no report: zero, not an error
    assert grade_workspace(problem, workspace).reward == 0.0


def test_editable_patterns_grade_other_files_in_their_template_version(tmp_path):
    _write(
        tmp_path / "p",
        {
            "instruction.md": "Fix calc.py.\n",
            "workspace/calc.py": PARTIAL,
            "workspace/expected.txt": "5\n",
            "tests/test_calc.py": "from pathlib import Path\nfrom calc import add\n\n\n"
            "def test_add():\n    assert str(add(2, 3)) == Path('expected.txt').read_text().strip()\n",
            "problem.toml": 'editable = ["calc.py"]\ngrade_timeout_s = 30\n',
        },
    )
    problem = load_problem(tmp_path / "p")
    assert problem.editable == ["calc.py"] and problem.grade_timeout_s == 30
    workspace = write_workspace(problem, tmp_path / "ws")
    assert grade_workspace(problem, workspace).reward == 1.0
    (workspace / "calc.py").write_text("def add(a, b):\n    return 7\n")
    (workspace / "expected.txt").write_text("7\n")  # not editable: the template's 5 is graded
    result = grade_workspace(problem, workspace)
    assert result.reward == 0.0 and "template version of expected.txt" in result.log


def test_hidden_tests_are_counted_from_the_source_and_grouped_per_function():
    source = """
import pytest, unittest


@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    pass


class TestGroup:
    def test_one(self):
        pass

    class TestNested:
        def test_two(self):
            pass


class NotCollected:
    def test_ignored(self):
        pass


class WithInit:
    def __init__(self):
        pass


class Legacy(unittest.TestCase):
    def test_old(self):
        pass


def helper():
    pass
"""
    ids = hidden_test_ids({"tests/test_a.py": source, "tests/helpers.py": "def test_no(): pass\n"})
    assert ids == [
        "tests/test_a.py::test_param",
        "tests/test_a.py::TestGroup::test_one",
        "tests/test_a.py::TestGroup::TestNested::test_two",
        "tests/test_a.py::Legacy::test_old",
    ]
    outcomes = {
        "tests/test_a.py::test_param[1]": True,
        "tests/test_a.py::test_param[2]": False,
        "tests/test_a.py::TestGroup::test_one": True,
        "tests/test_extra.py::test_agent": True,
    }
    passed, lines = score(ids, outcomes)
    assert passed == 1 and "FAIL tests/test_a.py::test_param" in lines
    assert "FAIL tests/test_a.py::Legacy::test_old - not reported" in lines


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"problem.toml": 'grade_timeout_s = "soon"\n'}, "grade_timeout_s must be a number"),
        ({"problem.toml": 'editable = "src"\n'}, "editable must be a list"),
        ({"problem.toml": 'grader = "nose"\n'}, 'grader must be "pytest"'),
        ({"problem.toml": 'grade_output = "junit"\n'}, "grade_output applies to a grade command"),
        ({"problem.toml": 'grader = "pytest"\ngrade = "true"\n'}, 'grader = "pytest" and a grade command'),
        ({"checks.py": "x = 1\n"}, "checks.py line 1: only imports"),
        ({"checks.py": "def check_a():\n    print(1)\n"}, "checks.py check_a"),
        ({"tests/test_a.py": "def helper():\n    pass\n"}, "no grader"),
        ({"tests/test_a.py": "def test_a(:\n"}, "does not parse"),
    ],
)
def test_malformed_folder_settings_name_the_folder_and_the_field(files, message, tmp_path):
    folder = tmp_path / "broken-one"
    _write(folder, {"instruction.md": "x\n", "tests/test_ok.py": "def test_ok():\n    pass\n", **files})
    if "tests/test_a.py" in files:
        (folder / "tests/test_ok.py").unlink()
    with pytest.raises(ProblemFolderError, match="broken-one") as raised:
        load_problem(folder)
    assert message in str(raised.value)
