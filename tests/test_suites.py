"""Problem suites as plugins (environments/suites): every kind loads (a folder, JSONL and Parquet
manifests, a module:function, an installed entry point, the built-ins), steps are apportioned by
weight and never train on held-out or validation problems, a campaign's split is recorded and a
changed suite refused on resume, and `gyre suite check` names each problem that is broken."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli.main import main
from environments.problems import generate
from environments.suites import (
    FiniteSuite,
    GeneratedSuite,
    SuiteError,
    SuiteMix,
    SuiteSpec,
    apportion,
    installed_suites,
    open_suite,
)
from flows.config import CampaignConfig
from tasks.campaign import record_suites
from tasks.problems import EvaluationConfig, ProblemsConfig, held_out_problems, step_problems
from tasks.rollout import choose_problems as rollout_problems
from trajectory_store.storage import StoreConfig

GRADE = 'if [ -f done.txt ]; then echo \'{"passed": 1, "total": 1}\'; else echo \'{"passed": 0, "total": 1}\'; fi\n'


def problem_folder(
    root: Path, name: str, *, instruction: str = "Create done.txt.", grade: str = GRADE
) -> Path:
    folder = root / name
    (folder / "workspace").mkdir(parents=True)
    (folder / "workspace" / "README.md").write_text("a workspace\n")
    if instruction is not None:
        (folder / "instruction.md").write_text(instruction + "\n")
    (folder / "grade.sh").write_text(grade)
    return folder


def folder_suite(root: Path, count: int) -> Path:
    for index in range(count):
        problem_folder(root, f"p{index:02d}")
    return root


def record(problem_id: str, **changes) -> dict:
    """One manifest line: a command-graded problem whose reference solution writes done.txt."""
    return {
        "problem_id": problem_id,
        "instruction": "Create done.txt.",
        "files": {"README.md": "a workspace\n"},
        "grade_command": GRADE,
        "solution": [{"tool": "write_file", "arguments": {"path": "done.txt", "content": "yes\n"}}],
        **changes,
    }


def jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# -- each kind loads ---------------------------------------------------------------------------


def test_a_folder_suite_names_its_problems_after_the_suite(tmp_path):
    suite = open_suite(SuiteSpec("mine", path=str(folder_suite(tmp_path / "mine", 3)), harness=["h", "{x}"]))
    assert isinstance(suite, FiniteSuite) and not suite.errors
    assert [p.problem_id for p in suite.problems] == ["mine-p00", "mine-p01", "mine-p02"]
    assert {p.suite for p in suite.problems} == {"mine"}
    assert all(p.harness == ["h", "{x}"] for p in suite.problems)
    assert suite.problems[0].meta["suite_id"] == "folder-p00"


def test_jsonl_and_parquet_manifests_load_the_same_problems(tmp_path):
    records = [record("a"), record("b", difficulty=2, grade_timeout_s=5)]
    from_jsonl = open_suite(SuiteSpec("m", path=str(jsonl(tmp_path / "m.jsonl", records))))
    rows = [  # structured fields as JSON text; a null is the field's default
        {"difficulty": None, "grade_timeout_s": None, **r, "files": json.dumps(r["files"])}
        | {"solution": json.dumps(r["solution"])}
        for r in records
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    from_parquet = open_suite(SuiteSpec("m", path=str(tmp_path / "m.parquet")))
    assert not from_jsonl.errors and not from_parquet.errors
    assert [p.to_json() for p in from_jsonl.problems] == [p.to_json() for p in from_parquet.problems]
    assert [p.problem_id for p in from_jsonl.problems] == ["m-a", "m-b"]
    assert from_jsonl.problems[1].grade_timeout_s == 5 and from_jsonl.problems[1].solution


def test_a_manifest_error_names_the_line_and_the_field(tmp_path):
    path = jsonl(
        tmp_path / "bad.jsonl",
        [
            record("good"),
            "{not json",
            {k: v for k, v in record("x").items() if k != "instruction"},
            record("y", files=["not", "a", "map"]),
            record("z", colour="red"),
            record("good"),
        ],
    )
    suite = open_suite(SuiteSpec("bad", path=str(path)))
    assert [p.problem_id for p in suite.problems] == ["bad-good"]
    errors = "\n".join(suite.errors)
    assert f"{path} line 2: not valid JSON" in errors
    assert f"{path} line 3: field 'instruction' is missing" in errors
    assert f"{path} line 4: field 'files' must be a JSON object" in errors
    assert f"{path} line 5: unknown field(s) ['colour']" in errors
    assert f"{path} line 6: problem_id 'good' is also on line 1" in errors


PLUGIN = """
from environments.problems import Problem
from environments.suites import GeneratedSuite

GRADE = {grade!r}


def hard():
    return [Problem(problem_id=f"h{{i}}", suite="x", instruction="Create done.txt.", files={{}},
                    grade_command=GRADE) for i in range(2)]


def from_path(path):
    return [{{"problem_id": "p", "instruction": open(path).read(), "grade_command": GRADE}}]


def _generate(n, *, seed, difficulty, length):
    return [Problem(problem_id=f"g{{seed}}-{{i}}", suite="x", instruction="Create done.txt.", files={{}},
                    grade_command=GRADE) for i in range(n)]


endless = GeneratedSuite(_generate)
"""


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """A module on sys.path, and an installed distribution (a dist-info with entry_points.txt) whose
    gyrerl.suites entry points name its objects: what `pip install` of a suite package leaves."""
    (tmp_path / "my_suites.py").write_text(PLUGIN.format(grade=GRADE))
    info = tmp_path / "my_suites-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-suites\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[gyrerl.suites]\nhardone = my_suites:hard\nendless = my_suites:endless\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_suites", None)


def test_plugins_by_module_function_and_by_installed_entry_point(plugin_module):
    by_function = open_suite(SuiteSpec("hard", entry_point="my_suites:hard"))
    assert [p.problem_id for p in by_function.problems] == ["hard-h0", "hard-h1"]
    (plugin_module / "task.md").write_text("From a file.")
    with_path = open_suite(
        SuiteSpec("fp", entry_point="my_suites:from_path", path=str(plugin_module / "task.md"))
    )
    assert with_path.problems[0].instruction == "From a file." and with_path.problems[0].problem_id == "fp-p"
    assert {"hardone", "endless", "repo", "swe", "terminal"} <= set(installed_suites())
    installed = open_suite(SuiteSpec("hardone"))  # by name, through importlib.metadata entry points
    assert [p.problem_id for p in installed.problems] == ["hardone-h0", "hardone-h1"]
    endless = open_suite(SuiteSpec("endless"))
    assert isinstance(endless, GeneratedSuite)
    mix = SuiteMix.open([SuiteSpec("endless"), SuiteSpec("hardone")], seed=7, per_step=2)
    assert sorted(p.problem_id for p in mix.step_problems(0)) == ["endless-g7-0", "hardone-h0"] or sorted(
        p.problem_id for p in mix.step_problems(0)
    ) == ["endless-g7-0", "hardone-h1"]
    with pytest.raises(SuiteError, match="could not be loaded"):
        open_suite(SuiteSpec("x", entry_point="my_suites:nothing"))
    with pytest.raises(SuiteError, match="is no known suite"):
        open_suite(SuiteSpec("nosuch"))


def test_the_built_in_generators_are_plugins_and_give_what_generate_gives():
    from environments.problems import generate

    for name in ("repo", "swe", "terminal"):
        suite = open_suite(SuiteSpec.of(name))
        assert isinstance(suite, GeneratedSuite)
        made = suite.generate(2, seed=3, difficulty=1, length=1)
        assert [p.to_json() for p in made] == [p.to_json() for p in generate(name, 2, seed=3)]
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."gyrerl.suites"]' in pyproject
    assert 'repo = "environments.suites.sources:repo"' in pyproject


# -- choosing problems -------------------------------------------------------------------------


def test_apportion_gives_each_suite_its_quota_floor_or_ceiling_and_its_share_on_average():
    weights = [2.0, 1.0, 0.5]
    totals = collections.Counter()
    for step in range(3000):
        seats = apportion(weights, 3, f"k/{step}")
        assert sum(seats) == 3
        assert seats[0] in (1, 2) and seats[1] in (0, 1) and seats[2] in (0, 1)
        totals.update(dict(enumerate(seats)))
    expected = [3000 * 3 * w / sum(weights) for w in weights]
    for index, want in enumerate(expected):
        assert abs(totals[index] - want) < 0.05 * want, (totals, expected)
    assert apportion(weights, 3, "same") == apportion(weights, 3, "same")
    assert apportion([1.0, 1.0], 4, "x") == [2, 2]


def test_weighted_steps_mix_a_folder_suite_with_a_generator_and_never_train_held_out(tmp_path):
    suites = [
        SuiteSpec(
            "mine",
            path=str(folder_suite(tmp_path / "mine", 10)),
            weight=2,
            held_out=["p00", "mine-p01"],
            validation=0.2,
        ),
        SuiteSpec("terminal", weight=1),
    ]
    mix = SuiteMix.open(suites, seed=5000, per_step=3)
    split = mix.suites[0].split
    assert split.held_out == ["mine-p00", "mine-p01"] and split.validation  # 0.2 of 10 by hash
    counts: collections.Counter = collections.Counter()
    trained: collections.Counter = collections.Counter()
    for step in range(60):
        chosen = mix.step_problems(step)
        ids = [p.problem_id for p in chosen]
        assert len(ids) == 3 and len(set(ids)) == 3  # never one problem twice in a step
        assert mix.step_problems(step) == chosen  # deterministic
        counts.update(p.suite for p in chosen)
        trained.update(i for i in ids if i.startswith("mine-"))
    assert abs(counts["mine"] - 120) <= 12 and counts["mine"] + counts["terminal"] == 180
    assert set(trained) == set(split.train)  # epochs go through every training problem ...
    assert max(trained.values()) - min(trained.values()) <= 2  # ... evenly
    assert not set(trained) & set(split.held_out + split.validation)  # and never a held-out one
    held = [p.problem_id for p in mix.held_out(per_suite=8, seed=0)]
    assert held[:2] == ["mine-p00", "mine-p01"] and held[2].startswith("terminal-s0-")


def test_a_suite_too_small_for_its_share_is_refused_and_plain_names_keep_their_round_robin(tmp_path):
    small = SuiteSpec("small", path=str(folder_suite(tmp_path / "small", 2)), held_out=["p00"])
    with pytest.raises(SuiteError, match="suite small has 1 problems to train on, but a step may take 2"):
        SuiteMix.open([small], seed=0, per_step=2)
    legacy = ProblemsConfig(suites=["repo", "terminal"], per_step=2, seed=5000)
    assert legacy.round_robin
    ids = [p["problem_id"] for p in step_problems(legacy, 0)]
    assert ids == ["repo-s5000-d1l1-000", "terminal-s5000-d1l1-000"]


def test_the_campaign_config_reads_suite_tables_with_paths_beside_the_file(tmp_path):
    folder_suite(tmp_path / "problems", 4)
    config_file = tmp_path / "conf" / "campaign.toml"
    config_file.parent.mkdir()
    config_file.write_text(
        "[problems]\nper_step = 2\n"
        'suites = [{ name = "mine", path = "../problems", weight = 2, held_out = ["p03"] }, "repo"]\n'
    )
    config = CampaignConfig.from_toml(config_file)
    mine = config.problems.suites[0]
    assert isinstance(mine, SuiteSpec) and mine.path == str((tmp_path / "problems").resolve())
    assert config.problems.suites[1] == "repo" and not config.problems.round_robin
    steps = [step_problems(config.problems, step) for step in range(6)]
    assert {p["suite"] for step in steps for p in step} == {"mine", "repo"}
    assert "mine-p03" not in {p["problem_id"] for step in steps for p in step}
    held = [p["problem_id"] for p in held_out_problems(config.evaluation, config.problems)]
    assert held[0] == "mine-p03" and len(held) == 1 + config.evaluation.per_suite
    assert CampaignConfig.model_validate(config.model_dump(mode="json")) == config  # a flow parameter
    for bad, message in (
        ('[{ name = "a-b" }]', "suite name 'a-b' must be letters, digits and _"),
        ('[{ name = "a", wieght = 2 }]', "suite a: unknown key(s) ['wieght']"),
        ('[{ name = "a", weight = 0 }]', "suite a: weight must be > 0"),
        ('["repo", { name = "repo", path = "x" }]', "suites ['repo'] appear more than once"),
    ):
        config_file.write_text(f"[problems]\nsuites = {bad}\n")
        with pytest.raises(ValueError) as refused:
            CampaignConfig.from_toml(config_file)
        assert message in str(refused.value) and "[problems" in str(refused.value)


def test_the_split_is_recorded_once_and_a_changed_suite_is_refused_on_resume(tmp_path):
    root = folder_suite(tmp_path / "mine", 4)
    config = ProblemsConfig(
        suites=[{"name": "mine", "path": str(root), "held_out": ["p00"]}, "terminal"], per_step=2
    )
    store = StoreConfig(data_root=str(tmp_path / "data"), campaign="c")
    first = record_suites.fn(config, store)
    written = json.loads((tmp_path / "data" / "campaigns" / "c" / "suites.json").read_text())
    assert written == first
    mine = next(s for s in written["suites"] if s["name"] == "mine")
    assert sorted(mine["train"]) == ["mine-p01", "mine-p02", "mine-p03"] and list(mine["held_out"]) == [
        "mine-p00"
    ]
    assert record_suites.fn(config, store) == first  # the same suites: resumes
    (root / "p02" / "instruction.md").write_text("Something else.\n")
    problem_folder(root, "p04")
    with pytest.raises(ValueError) as refused:
        record_suites.fn(config, store)
    message = str(refused.value)
    assert "suite mine: problem mine-p02 changed" in message
    assert "suite mine: problem mine-p04 was added (train)" in message
    moved = config.model_copy(
        update={"suites": [SuiteSpec("mine", path=str(root), held_out=["p01"]), "terminal"]}
    )
    with pytest.raises(ValueError, match="problem mine-p00 moved from held_out to train"):
        record_suites.fn(moved, store)


def test_gyre_rollout_takes_a_manifest_or_an_installed_suite(tmp_path, plugin_module):
    path = jsonl(tmp_path / "m.jsonl", [record("a"), record("b"), "oops"])
    problems = rollout_problems("folder", 5, folder=str(path))
    assert [p.problem_id for p in problems] == ["manifest-a", "manifest-b"]
    assert [p.problem_id for p in rollout_problems("hardone", 1)] == ["hardone-h0"]
    assert len(rollout_problems("endless", 3, seed=2)) == 3


# -- gyre suite check -------------------------------------------------------------------------


def test_suite_check_passes_a_good_suite(tmp_path, capsys):
    path = jsonl(tmp_path / "good.jsonl", [record("a"), record("b")])
    assert main(["suite", "check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert (
        out[0] == "ok   a: untouched 0.00, reference 1.00"
    )  # the id held_out takes, whatever the suite's name
    assert out[-1] == "2 problem(s) checked: 2 ok, 0 failed"


def test_suite_check_names_each_broken_problem_and_exits_1(tmp_path, capsys):
    wrong = [{"tool": "write_file", "arguments": {"path": "other.txt", "content": "no\n"}}]
    path = jsonl(
        tmp_path / "broken.jsonl",
        [
            record("solved", files={"done.txt": "already\n"}),
            record("wrongref", solution=wrong),
            record("hangs", grade_command="sleep 100", grade_timeout_s=2),
            record("noisy", grade_command="echo not a summary"),
            {"problem_id": "bare", "files": {}},
            record("fine"),
        ],
    )
    assert main(["suite", "check", str(path)]) == 1
    out = capsys.readouterr().out
    lines = {line.split(":")[0].split()[-1]: line for line in out.splitlines() if ":" in line}
    assert "already scores 1.0" in lines["solved"]
    assert "reference solution scores 0.00, not 1.0" in lines["wrongref"]
    assert "grader did not finish within 2 s" in lines["hangs"]
    assert "grader failed" in lines["noisy"] and "Traceback" not in out
    assert "FAIL" in out and f"{path} line 5" in out and "field 'instruction' is missing" in out
    assert lines["fine"].startswith("ok ")
    assert out.splitlines()[-1] == "6 problem(s) checked: 1 ok, 5 failed"


def test_suite_check_of_a_folder_names_a_malformed_problem_folder(tmp_path, capsys):
    root = folder_suite(tmp_path / "suite", 1)
    problem_folder(root, "noinstr", instruction=None)
    assert main(["suite", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {root / 'noinstr'}: malformed: instruction.md is missing" in out
    assert "ok   p00: untouched 0.00, no reference solution" in out


def test_a_pool_of_a_generated_suite_trains_in_epochs_and_still_evaluates_from_its_seed(tmp_path):
    config = ProblemsConfig(
        suites=[{"name": "mine", "path": str(folder_suite(tmp_path / "mine", 3))}, "repo"], per_step=2, pool=2
    )
    steps = [[p["problem_id"] for p in step_problems(config, step)] for step in range(4)]
    repo = {i for step in steps for i in step if i.startswith("repo-")}
    assert repo == {"repo-s5000-d1l1-000", "repo-s5000-d1l1-001"}  # the pool, from generator seed seed
    held = [p["problem_id"] for p in held_out_problems(EvaluationConfig(per_suite=2), config)]
    assert held == ["repo-s0-d1l1-000", "repo-s0-d1l1-001"]  # mine has no held_out part


def test_suite_check_names_each_problem_by_the_id_held_out_takes(tmp_path, capsys):
    path = jsonl(tmp_path / "durations.jsonl", [record("durations"), record("other")])
    assert main(["suite", "check", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()[:-1]
    printed = [line.split()[1].rstrip(":") for line in lines if not line.startswith(" ")]  # not the notes
    assert printed == ["durations", "other"]  # not durations-durations: the suite's name is the campaign's
    config = ProblemsConfig(suites=[{"name": "mine", "path": str(path), "held_out": printed[:1]}], per_step=1)
    assert [p["problem_id"] for p in held_out_problems(EvaluationConfig(), config)] == ["mine-durations"]


def test_suite_check_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    for target in (tmp_path / "my-taks", tmp_path / "tasks.jsonl"):
        assert main(["suite", "check", str(target)]) == 2
        assert capsys.readouterr().err == f"gyre: error: no such folder or file: {target}\n"
    assert main(["suite", "check", "mytasks"]) == 2  # could be a suite's name: the known ones are listed
    assert (
        "no such folder or file: " in (err := capsys.readouterr().err) and "nor a suite of that name: " in err
    )


def test_suite_check_shows_what_a_failing_solution_script_printed_and_which_tests_a_reference_fails(
    tmp_path, capsys
):
    root = tmp_path / "suite"
    script = problem_folder(root, "script")
    (script / "solution.sh").write_text("echo 'writing done.txt'\necho 'disk full' >&2\nexit 3\n")
    tested = root / "tested"
    (tested / "workspace").mkdir(parents=True)
    (tested / "instruction.md").write_text("Fix median() in stats.py.\n")
    (tested / "workspace" / "stats.py").write_text("def median(v):\n    return sorted(v)[len(v) // 2]\n")
    tests = "from stats import median\n\n\ndef test_odd():\n    assert median([3, 1, 2]) == 2\n\n\n"
    tests += "def test_even():\n    assert median([4, 1, 3, 2]) == 2.5\n\n\ndef test_pair():\n    assert median([0, 10]) == 5\n"
    (tested / "tests").mkdir()
    (tested / "tests" / "test_stats.py").write_text(tests)
    (tested / "solution").mkdir()  # right for [4, 1, 3, 2] only
    (tested / "solution" / "stats.py").write_text(
        "def median(v):\n    return 2.5 if len(v) == 4 else sorted(v)[0]\n"
    )
    assert main(["suite", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert "FAIL script: reference solution: solution.sh exited with 3\n" in out
    assert "     stdout:\n       | writing done.txt\n     stderr:\n       | disk full\n" in out
    assert "FAIL tested: reference solution scores 0.33, not 1.0\n     2 of 3 failed:\n" in out
    assert (
        "     FAIL tests/test_stats.py::test_odd" in out and "     FAIL tests/test_stats.py::test_pair" in out
    )
    assert "test_even" not in out


CHECKS = [
    {"name": "made", "code": "expect(Path('done.txt').exists(), 'done.txt is missing')"},
    {"name": "said", "code": "expect_equal(Path('done.txt').read_text(), 'yes\\n', 'its text')"},
]


def test_a_manifest_holds_checks_as_their_source_or_compiled_and_a_bad_one_is_named(tmp_path, capsys):
    compiled = next(p for p in generate("terminal", 3, seed=1) if p.checks).to_json()
    lines = [
        {k: v for k, v in record("source", checks=CHECKS).items() if k != "grade_command"},
        {k: v for k, v in record("typo", checks=[{"name": "c", "source": "expect(True, 'x')"}]).items()},
        {**compiled, "problem_id": "compiled", "suite": "m"},
        {k: v for k, v in record("half", checks=[{"name": "c"}]).items() if k != "grade_command"},
    ]
    path = jsonl(tmp_path / "m.jsonl", lines)
    suite = open_suite(SuiteSpec("m", path=str(path)))
    assert [p.problem_id for p in suite.problems] == ["m-source", "m-compiled"]
    assert [c.name for c in suite.problems[0].checks] == ["made", "said"]
    forms = "a check has name and code, or name, probe, expected, imports_workspace (compiled)"
    assert suite.errors == [
        f"{path} line 2: checks[0]: unknown field(s) 'source'; {forms}",
        f"{path} line 4: checks[0]: missing field(s) 'probe', 'expected'; {forms}",
    ]
    assert main(["suite", "check", str(path)]) == 1
    assert "ok   source: untouched 0.00, reference 1.00" in capsys.readouterr().out
