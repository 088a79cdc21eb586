"""Problem suites and graders: every generated problem is solvable by its reference solution and not
by doing nothing, graders give partial credit, generation is deterministic, and the folder loader
reports broken problems without losing the good ones. All grading runs real subprocesses."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from environments.problems import (
    SUITES,
    GraderError,
    Problem,
    apply_solution,
    generate,
    grade_workspace,
    load_folder,
    parse_grade_output,
    read_folder,
    write_workspace,
)
from environments.problems.grading import run_grade_command
from environments.sandbox import Sandbox
from environments.tools import TOOL_NAMES as TOOLS

GENERATED = ("repo", "swe", "terminal")


def _workspace(problem: Problem, root: Path, name: str, *, solved: bool) -> Path:
    workspace = write_workspace(problem, root / name)
    if solved:
        apply_solution(problem, workspace)
    return workspace


def _problem(command: str, **overrides) -> Problem:
    fields = dict(
        problem_id="custom-000",
        suite="folder",
        instruction="do nothing",
        files={"a.txt": "a\n"},
        hidden_tests={},
        grade_command=command,
    )
    return Problem(**(fields | overrides))


# ------------------------------------------------------------------------- generated suites


@pytest.mark.parametrize("difficulty", [1, 2, 3])
@pytest.mark.parametrize("suite", GENERATED)
def test_reference_solution_scores_one_and_untouched_workspace_zero(suite, difficulty, tmp_path):
    length = 2 if difficulty == 3 else 1
    for problem in generate(suite, 2, seed=11, difficulty=difficulty, length=length):
        untouched = _workspace(problem, tmp_path, f"{problem.problem_id}-untouched", solved=False)
        solved = _workspace(problem, tmp_path, f"{problem.problem_id}-solved", solved=True)
        before = grade_workspace(problem, untouched)
        after = grade_workspace(problem, solved)
        assert after.reward == 1.0, f"{problem.problem_id}\n{problem.instruction}\n{after.log}"
        assert before.reward == 0.0, f"{problem.problem_id}\n{problem.instruction}\n{before.log}"
        assert after.total == before.total == problem.meta["items"]
        assert problem.solution[-1]["tool"] == "finish"
        assert all(step["tool"] in TOOLS for step in problem.solution)


def test_generated_text_is_ascii_and_round_trips_through_json():
    for suite in GENERATED:
        for problem in generate(suite, 2, seed=3, difficulty=4, length=3):
            data = json.loads(json.dumps(problem.to_json()))
            assert Problem.from_json(data) == problem
            texts = [problem.instruction, *problem.files.values(), *problem.hidden_tests.values()]
            assert all(text.isascii() for text in texts), problem.problem_id


def test_terminal_partial_credit_grows_with_each_operation(tmp_path):
    problem = generate("terminal", 1, seed=2, difficulty=4)[0]
    workspace = write_workspace(problem, tmp_path / "ws")
    rewards = [grade_workspace(problem, workspace).reward]
    for step in problem.solution:
        apply_solution(Problem.from_json(problem.to_json() | {"solution": [step]}), workspace)
        if step["tool"] in ("write_file", "run"):
            rewards.append(grade_workspace(problem, workspace).reward)
    assert rewards[0] == 0.0 and rewards[-1] == 1.0
    assert rewards == sorted(rewards)
    assert {0.25, 0.5, 0.75} <= set(rewards)


def test_repo_half_the_functions_gives_half_the_reward(tmp_path):
    problem = generate("repo", 1, seed=4, difficulty=2)[0]
    write = next(s for s in problem.solution if s["tool"] == "write_file")["arguments"]
    first_function_only = write["content"].split("\n\n\ndef ")
    assert len(first_function_only) == 3  # docstring, two functions
    workspace = write_workspace(problem, tmp_path / "ws")
    (workspace / write["path"]).write_text("\n\n\ndef ".join(first_function_only[:2]) + "\n")
    result = grade_workspace(problem, workspace)
    assert (result.passed, result.total, result.reward) == (1, 2, 0.5)


def test_swe_fixing_one_of_two_bugs_gives_half_and_breaking_a_healthy_function_gives_nothing(tmp_path):
    problem = generate("swe", 1, seed=5, difficulty=2)[0]
    write = next(s for s in problem.solution if s["tool"] == "write_file")["arguments"]
    path = write["path"]
    buggy, fixed = problem.files[path].split("\n\n\n"), write["content"].split("\n\n\n")
    changed = [i for i, (b, f) in enumerate(zip(buggy, fixed, strict=True)) if b != f]
    assert len(changed) == 2
    workspace = write_workspace(problem, tmp_path / "ws")

    half = list(buggy)
    half[changed[0]] = fixed[changed[0]]
    (workspace / path).write_text("\n\n\n".join(half))
    assert grade_workspace(problem, workspace).reward == 0.5

    healthy = next(i for i in range(1, len(fixed)) if i not in changed)
    broken = list(fixed)
    broken[healthy] = broken[healthy].replace("return ", "return None and ", 1)
    (workspace / path).write_text("\n\n\n".join(broken))
    assert grade_workspace(problem, workspace).reward == 0.0


@pytest.mark.parametrize("suite", ["repo", "swe"])
def test_visible_tests_fail_before_and_pass_after_the_reference_solution(suite, tmp_path):
    problem = generate(suite, 1, seed=6, difficulty=2)[0]
    for solved in (False, True):
        workspace = _workspace(problem, tmp_path, f"ws-{solved}", solved=solved)
        result = run_grade_command(problem.visible_test_command, Sandbox(workspace), 30)
        passed, total = parse_grade_output(result.stdout)
        assert (passed == total) is solved, result.stdout + result.stderr
    assert "FAIL" not in result.stdout


def test_hanging_or_exiting_agent_code_loses_checks_instead_of_breaking_the_grader(tmp_path):
    problem = generate("repo", 1, seed=8, difficulty=1)[0]
    module = next(s for s in problem.solution if s["tool"] == "write_file")["arguments"]["path"]
    workspace = write_workspace(problem, tmp_path / "ws")
    (workspace / module).write_text("import sys\nprint('noise')\nsys.exit(3)\n")
    assert grade_workspace(problem, workspace).reward == 0.0
    (workspace / module).write_text("while True:\n    pass\n")
    started = time.monotonic()
    result = grade_workspace(problem, workspace)
    assert result.reward == 0.0 and "timed out" in result.log
    assert time.monotonic() - started < 30  # a lost check, not the whole grade's 60 s


def test_generate_is_deterministic_and_varies_with_seed_and_knobs():
    for suite in GENERATED:
        first = [p.to_json() for p in generate(suite, 4, seed=7, difficulty=2)]
        assert first == [p.to_json() for p in generate(suite, 4, seed=7, difficulty=2)]
        other = generate(suite, 4, seed=8, difficulty=2)
        assert {p["instruction"] for p in first}.isdisjoint({p.instruction for p in other})
        assert len({p["instruction"] for p in first}) == 4
        ids = [
            p.problem_id
            for seed in (7, 8)
            for d in (1, 2)
            for p in generate(suite, 3, seed=seed, difficulty=d)
        ]
        assert len(set(ids)) == len(ids)
    assert generate("terminal", 1, seed=7)[0].problem_id == "terminal-s7-d1l1-000"


def test_difficulty_and_length_grow_the_problem():
    for suite in GENERATED:
        easy = generate(suite, 5, seed=1, difficulty=1, length=1)
        hard = generate(suite, 5, seed=1, difficulty=3, length=3)
        assert all(p.meta["items"] == 1 for p in easy) and all(p.meta["items"] == 3 for p in hard)
        assert sum(len(p.instruction) for p in hard) > 1.5 * sum(len(p.instruction) for p in easy)
        assert sum(len(json.dumps(p.solution)) for p in hard) > 1.5 * sum(
            len(json.dumps(p.solution)) for p in easy
        )


def test_unknown_suite_and_bad_knobs_are_rejected():
    with pytest.raises(ValueError, match=r"'chess'.*known suites"):
        generate("chess", 1)
    with pytest.raises(ValueError, match="difficulty"):
        generate("terminal", 1, difficulty=0)
    assert set(GENERATED) <= set(SUITES)


# ------------------------------------------------------------------------------------- grading


def test_parse_grade_output_takes_the_last_line_and_rejects_anything_else():
    assert parse_grade_output('PASS a\n{"passed": 2, "total": 3}\n\n') == (2, 3)
    for bad in ["", "ok", '{"passed": 2, "total": 3}\nall good', '{"passed": 4, "total": 3}', "[1, 2]"]:
        with pytest.raises(GraderError):
            parse_grade_output(bad)
    for bad in ['{"passed": true, "total": 1}', '{"passed": 0, "total": 0}', '{"passed": 1}']:
        with pytest.raises(GraderError):
            parse_grade_output(bad)


def test_unparseable_grader_output_a_crash_and_a_timeout_score_zero_with_the_reason(tmp_path):
    """The agent's code runs in a grade command and can stop it before its summary: that is a 0 with
    its reason, never an error (an error is never trained on: an escape from the zero)."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    unparseable = grade_workspace(_problem("echo '5 tests passed'"), workspace)
    assert unparseable.reward == 0.0 and "not JSON" in unparseable.ungraded
    crashed = grade_workspace(_problem("exit 2"), workspace)
    assert crashed.reward == 0.0 and "printed nothing" in crashed.ungraded and "exit code 2" in crashed.log
    started = time.monotonic()
    # a grade that hangs (the agent's code can make it) scores 0, never an error that escapes the zero;
    # the grandchild keeps the pipes open: the whole process group must be killed
    hung = grade_workspace(_problem("sleep 30 & sleep 30"), workspace, timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert hung.reward == 0.0 and "timed out after 0.5 s" in hung.log


def test_grading_uses_a_fresh_copy_with_hidden_files_and_the_current_python(tmp_path):
    command = "python -c 'import sys; print(sys.executable)'; cat secret/key.txt; touch touched"
    problem = _problem(command, hidden_tests={"secret/key.txt": '{"passed": 1, "total": 2}\n'})
    workspace = write_workspace(problem, tmp_path / "ws")
    (workspace / "secret").symlink_to(tmp_path)  # the agent's link must not redirect the hidden file
    result = grade_workspace(problem, workspace)
    assert (result.passed, result.total, result.reward) == (1, 2, 0.5)
    assert not (workspace / "touched").exists() and not (tmp_path / "key.txt").exists()
    assert Path(result.log.splitlines()[0]).parent == Path(__import__("sys").executable).parent


def test_problem_rejects_paths_outside_the_workspace_and_unknown_tools():
    with pytest.raises(ValueError, match="stay inside"):
        _problem("true", files={"../x": ""})
    with pytest.raises(ValueError, match="solution action"):
        _problem("true", solution=[{"tool": "sudo", "arguments": {}}])


def test_apply_solution_raises_when_a_command_fails(tmp_path):
    problem = _problem("true", solution=[{"tool": "run", "arguments": {"command": "false"}}])
    with pytest.raises(RuntimeError, match="command exited with 1"):
        apply_solution(problem, tmp_path)


# ---------------------------------------------------------------------------------- folder loader


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


GOOD_GRADE = """python - <<'EOF'
import json, subprocess
ok = subprocess.run(["python", "tests/check.py"]).returncode == 0
print(json.dumps({"passed": int(ok) + 1, "total": 2}))
EOF
"""


def test_folder_loader_keeps_good_problems_and_reports_broken_ones(tmp_path, caplog):
    _write(
        tmp_path / "bench",
        {
            "good/instruction.md": "Make greet() in hello.py return 'hi'.\n",
            "good/workspace/hello.py": "def greet():\n    return 'bye'\n",
            "good/tests/check.py": "import sys\nsys.path.insert(0, '.')\nimport hello\nassert hello.greet() == 'hi'\n",
            "good/grade.sh": GOOD_GRADE,
            "exit/instruction.md": "Create done.txt.\n",
            "exit/problem.toml": 'id = "exit-code"\ndifficulty = 2\ngrade = "test -f done.txt"\ngrade_output = "exit_code"\n',
            "broken/instruction.md": "No grader here.\n",
            "broken/workspace/a.txt": "a\n",
            "typo/instruction.md": "x\n",
            "typo/problem.toml": 'grade = "true"\ngrade_outptu = "json"\n',
            "README.md": "not a problem\n",
        },
    )
    found = read_folder(tmp_path / "bench")
    assert [p.problem_id for p in found.problems] == ["folder-exit-code", "folder-good"]
    assert len(found.errors) == 2
    assert "broken" in found.errors[0] and "grade.sh" in found.errors[0]
    assert "typo" in found.errors[1] and "grade_outptu" in found.errors[1]

    with caplog.at_level(logging.WARNING):
        problems = load_folder(tmp_path / "bench")
    assert len(problems) == 2 and "broken" in caplog.text
    with pytest.raises(ValueError, match="2 broken"):
        load_folder(tmp_path / "bench", strict=True)

    exit_code, good = problems
    assert good.files == {"hello.py": "def greet():\n    return 'bye'\n"} and good.solution == []
    assert "tests/check.py" in good.hidden_tests and exit_code.difficulty == 2
    workspace = write_workspace(good, tmp_path / "ws-good")
    assert grade_workspace(good, workspace).reward == 0.5
    (workspace / "hello.py").write_text("def greet():\n    return 'hi'\n")
    assert grade_workspace(good, workspace).reward == 1.0

    workspace = write_workspace(exit_code, tmp_path / "ws-exit")
    assert grade_workspace(exit_code, workspace).reward == 0.0
    (workspace / "done.txt").write_text("")
    assert grade_workspace(exit_code, workspace).reward == 1.0


def test_folder_loader_errors_when_nothing_loads(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_folder(tmp_path / "missing")
    _write(tmp_path, {"only/workspace/a.txt": "a\n"})
    with pytest.raises(ValueError, match=r"only: instruction.md is missing"):
        load_folder(tmp_path)
