"""The built-in harness and the dispatcher against the real gateway (scripted engine, see
tests/scripted_engine.py): every tool, compression, delegation, retry by branching, timeout ->
snapshot -> partial reward, harness crash, grader failure, and an external harness process."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import openai
import pyarrow.compute as pc
import pytest

from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.harness import Harness, HarnessConfig
from environments.problems import Problem, grade_workspace
from environments.problems.checks import compile_check
from environments.sandbox import Sandbox, SandboxLimits
from environments.snapshot import extract_snapshot
from environments.snapshot_rows import export_snapshot
from tests.scripted_engine import scripted_stack, tool_call
from tests.test_gateway_fixtures import ADMIN_TOKEN
from trajectory_store.db import connect, read_only_query
from trajectory_store.snapshots import SnapshotStore
from trajectory_store.storage import Store

pytestmark = pytest.mark.slow


def two_file_problem(problem_id: str = "two-files") -> Problem:
    """Write a.txt = 'alpha' and b.txt = 'beta': two hidden checks, so half done = reward 0.5."""
    checks = [
        ("a", "expect_equal(lines_of('a.txt'), ['alpha'], 'a.txt')"),
        ("b", "expect_equal(lines_of('b.txt'), ['beta'], 'b.txt')"),
    ]
    return Problem(
        problem_id=problem_id,
        suite="terminal",
        instruction="Create a.txt containing alpha and b.txt containing beta.",
        files={"README.md": "two files\n"},
        checks=[compile_check(name, code) for name, code in checks],
        visible_test_command="ls",
    )


def turns(text: str) -> int:
    """How many tool results the prompt holds (the agent's progress in this context)."""
    return text.count("<tool_response>")


def last_user_turn(text: str) -> str:
    return text.rsplit("<|im_start|>user", 1)[-1]


def run_harness(stack, execution_id: str, problem: Problem, tmp_path: Path, **config) -> tuple:
    registration = stack.register(execution_id)
    client = openai.OpenAI(base_url=registration["base_url"], api_key=registration["api_key"], max_retries=0)
    sandbox = Sandbox.create(tmp_path, execution_id, problem.files)
    stats = Harness(client, sandbox, problem, HarnessConfig(**config)).run()
    stack.finish(execution_id)
    return stats, sandbox, stack.calls(execution_id)


def test_every_tool_and_finish(tmp_path):
    script = [
        tool_call("list_files", path="."),
        tool_call("read_file", path="README.md"),
        tool_call("write_file", path="a.txt", content="alpha\n"),
        tool_call("run", command="echo beta > b.txt && cat b.txt"),
        tool_call("run_tests"),
        tool_call("finish", summary="both written"),
    ]

    def policy(text: str) -> str:
        return script[min(turns(text), len(script) - 1)]

    problem = two_file_problem()
    with scripted_stack(str(tmp_path), policy) as stack:
        stats, sandbox, calls = run_harness(stack, "tools-1", problem, tmp_path)
    assert stats.status == "finished" and stats.finish_summary == "both written"
    assert stats.calls == 6 and stats.tool_calls == 6 and stats.branches == 0
    assert grade_workspace(problem, sandbox.workspace).reward == 1.0
    assert [row["role"] for row, _ in calls] == ["main"] * 6
    # each call's prompt extends the previous call's whole sequence: one linear path, exact tokens
    for (_, sequence), (_, previous) in zip(calls[1:], calls[:-1], strict=True):
        assert sequence[: len(previous)] == previous
    # what the tools returned reached the model
    last_prompt = calls[-1][1][: calls[-1][0]["prompt_len"]]
    text = stack_tokenizer_decode(last_prompt)
    assert "two files" in text and "wrote a.txt" in text and "beta" in text


def test_tools_meeting_what_the_agent_made_answer_with_errors_and_never_crash(tmp_path):
    """Loops, a tree deeper than any recursion, a full disk, a path that is not a string: a crashed
    harness is an execution never trained on (an escape from its reward), so each is a tool answer."""
    script = [
        tool_call(
            "run",
            command="ln -s b a; ln -s a b; mkdir -p x; cd x; for i in $(seq 1500); do mkdir d; cd d; done",
        ),
        tool_call("read_file", path="a"),
        tool_call("list_files", path="."),
        tool_call("write_file", path="big.txt", content="z" * 6000),
        tool_call("list_files", path=7),
        tool_call("finish", summary="done"),
    ]

    def policy(text: str) -> str:
        return script[min(turns(text), len(script) - 1)]

    problem = two_file_problem()
    registration_root = tmp_path / "ws"
    with scripted_stack(str(tmp_path), policy) as stack:
        registration = stack.register("hostile-1")
        client = openai.OpenAI(
            base_url=registration["base_url"], api_key=registration["api_key"], max_retries=0
        )
        limits = SandboxLimits(disk_bytes=4 << 10, disk_files=5000)  # the 6 kB write passes the quota
        sandbox = Sandbox.create(registration_root, "hostile-1", problem.files, limits)
        try:
            config = HarnessConfig(max_retries=0, context_budget_tokens=30_000, max_tokens=8192)
            stats = Harness(client, sandbox, problem, config).run()
        finally:
            sandbox.release()
        stack.finish("hostile-1")
    assert stats.status == "finished" and stats.tool_errors == 2 and len(stats.violations) == 1, stats


def stack_tokenizer_decode(ids: list[int]) -> str:
    from tests.test_gateway_fixtures import tokenizer

    return tokenizer().decode(ids, skip_special_tokens=False)


def test_compression_starts_a_new_context_from_the_summary(tmp_path):
    def policy(text: str) -> str:
        if "Summarize what you have done" in last_user_turn(text):
            return "SUMMARY: listed the files twice"
        if "SUMMARY: listed the files twice" in text:
            return tool_call("finish", summary="after compression")
        return tool_call("run", command="seq 1 200")  # long tool results fill the context

    with scripted_stack(str(tmp_path), policy) as stack:
        stats, _, calls = run_harness(
            stack, "compress-1", two_file_problem(), tmp_path, context_budget_tokens=900, max_turns=10
        )
    roles = [row["role"] for row, _ in calls]
    assert stats.summaries >= 1 and "main_summary" in roles
    assert stats.status == "finished" and stats.finish_summary == "after compression"
    after = calls[roles.index("main_summary") + 1]
    assert after[0]["role"] == "main"
    # the new context is not an extension of the old one: a new root path in the tree
    before = calls[roles.index("main_summary") - 1][1]
    assert after[1][: len(before)] != before


def test_delegation_runs_a_sub_agent_with_its_own_context(tmp_path):
    def policy(text: str) -> str:
        if "write b.txt for me" in text.split("<|im_start|>user", 2)[1]:  # the sub-agent's instruction
            if turns(text) == 0:
                return tool_call("write_file", path="b.txt", content="beta\n")
            return tool_call("finish", summary="sub wrote b.txt")
        if turns(text) == 0:
            return tool_call("write_file", path="a.txt", content="alpha\n")
        if turns(text) == 1:
            return tool_call("delegate", instruction="write b.txt for me")
        return tool_call("finish", summary="done with help")

    problem = two_file_problem()
    with scripted_stack(str(tmp_path), policy) as stack:
        stats, sandbox, calls = run_harness(stack, "delegate-1", problem, tmp_path)
    assert stats.subagents == 1 and stats.status == "finished"
    assert grade_workspace(problem, sandbox.workspace).reward == 1.0
    by_agent = {}
    for row, _ in calls:
        by_agent.setdefault(row["agent_id"], []).append(row["role"])
    assert by_agent == {"main": ["main"] * 3, "sub1": ["sub", "sub"]}
    main_last = [seq for row, seq in calls if row["agent_id"] == "main"][-1]
    assert "sub wrote b.txt" in stack_tokenizer_decode(main_last)


def test_a_failed_step_is_retried_by_branching_from_the_same_context(tmp_path):
    seen: dict[str, int] = {}

    def policy(text: str) -> str:
        seen[text] = seen.get(text, 0) + 1
        if turns(text) == 0 and seen[text] == 1:
            return "I will just talk instead of calling a tool."  # a failed step: no tool call
        if turns(text) == 0 and seen[text] == 2:
            return tool_call("read_file", path="../../etc/passwd")  # refused: another failed step
        return tool_call("finish", summary="ok")

    with scripted_stack(str(tmp_path), policy) as stack:
        stats, _, calls = run_harness(stack, "retry-1", two_file_problem(), tmp_path, max_retries=3)
    assert stats.branches == 2 and stats.status == "finished"
    assert len(stats.violations) == 1, stats.violations
    prompts = [seq[: row["prompt_len"]] for row, seq in calls]
    assert prompts[0] == prompts[1] == prompts[2]  # three samples from one context: a branched tree
    assert len({tuple(seq) for _, seq in calls[:3]}) == 3


def _dispatch(stack, problems, tmp_path, **config):
    config = DispatchConfig(workspace_root=str(tmp_path / "ws"), **config)
    return asyncio.run(dispatch(problems, stack.url, ADMIN_TOKEN, stack.store_config, config))


def test_timeout_is_graded_from_the_workspace_snapshot(tmp_path):
    def policy(text: str) -> str:
        if turns(text) == 0:
            return tool_call("write_file", path="a.txt", content="alpha\n")
        return tool_call("run", command="sleep 0.3")  # never finishes: the deadline stops it

    problem = two_file_problem("stalls")
    with scripted_stack(str(tmp_path), policy) as stack:
        [outcome] = _dispatch(
            stack,
            [problem],
            tmp_path,
            timeout_s=6.0,
            durations=DurationProfile(short_turns=1000, long_fraction=0.0),
        )
        executions = Store(stack.store_config).read_table("executions").to_pylist()
    assert outcome.status == "timeout" and outcome.reward_source == "workspace_snapshot"
    assert outcome.reward == 0.5 and outcome.grade == {"passed": 1, "total": 2}
    assert outcome.calls >= 2
    [row] = [e for e in executions if e["execution_id"] == outcome.execution_id]
    assert row["status"] == "timeout" and row["reward"] == 0.5 and row["snapshot_uri"] == outcome.snapshot_uri
    # graded from Parquet rows: the snapshot part, its blobs, and the problem's template beside it
    assert "/snapshots/step=0/" in outcome.snapshot_uri and outcome.snapshot_uri.endswith(".parquet")
    store = Store(stack.store_config)
    assert not store.fs.exists(store.path("snapshots", f"{outcome.execution_id}.tar.gz"))  # no second copy
    data = export_snapshot(SnapshotStore(store), outcome.snapshot_uri)
    assert sorted(extract_snapshot(data, tmp_path / "check")) == ["README.md", "a.txt"]
    con = connect(store, read_only=True)
    changes = read_only_query(
        con,
        "SELECT c.path, c.change, f.text, e.reward FROM snapshot_changes c JOIN executions e USING (execution_id) "
        "LEFT JOIN snapshot_files f USING (execution_id, path) ORDER BY c.path",
    ).fetchall()
    assert changes == [("README.md", "unchanged", "two files\n", 0.5), ("a.txt", "added", "alpha\n", 0.5)]


def test_crash_grader_failure_and_success_are_all_recorded(tmp_path):
    def policy(text: str) -> str:
        if turns(text) == 0:
            return tool_call("write_file", path="a.txt", content="alpha\n")
        return tool_call("finish", summary="half")

    good = two_file_problem("good")
    broken_grader = Problem(  # broken whatever the workspace holds: its hidden test does not parse
        **{
            **good.to_json(),
            "problem_id": "bad-grader",
            "checks": [],
            "grader": "pytest",
            "hidden_tests": {"tests/test_a.py": "def test_a(:\n"},
        }
    )
    crashing = Problem(**{**good.to_json(), "problem_id": "crash", "files": {"README.md": "x\n"}})
    with scripted_stack(str(tmp_path), policy) as stack:
        outcomes = _dispatch(
            stack,
            [good, broken_grader],
            tmp_path,
            grader_retries=1,
            durations=DurationProfile(short_turns=5, long_fraction=0.0),
            snapshot_completed=True,  # final workspaces stored too, comparable with timed-out ones
        )
        # a harness that dies: an external command that exits 1 after printing
        [crashed] = _dispatch(
            stack,
            [crashing],
            tmp_path,
            harness_command=[sys.executable, "-c", "import sys; print('boom'); sys.exit(1)"],
        )
        rows = {e["execution_id"]: e for e in Store(stack.store_config).read_table("executions").to_pylist()}
    by_problem = {o.problem_id: o for o in [*outcomes, crashed]}
    assert by_problem["good"].status == "completed" and by_problem["good"].reward == 0.5
    assert by_problem["good"].reward_source == "final"
    assert by_problem["bad-grader"].status == "eval_failed" and by_problem["bad-grader"].reward is None
    assert "2 times" in by_problem["bad-grader"].error
    assert crashed.status == "error" and crashed.log_uri and "boom" in Path(crashed.log_uri).read_text()
    assert {rows[o.execution_id]["status"] for o in by_problem.values()} == {
        "completed",
        "eval_failed",
        "error",
    }
    assert crashed.snapshot_uri is None and rows[by_problem["good"].execution_id]["snapshot_uri"]
    con = connect(Store(stack.store_config), read_only=True)
    final = read_only_query(
        con, "SELECT problem_id, source, path, change FROM snapshot_changes ORDER BY ALL"
    ).fetchall()
    assert final == [
        ("bad-grader", "final", "README.md", "unchanged"),
        ("bad-grader", "final", "a.txt", "added"),
        ("good", "final", "README.md", "unchanged"),
        ("good", "final", "a.txt", "added"),
    ]


EXTERNAL_AGENT = """
import os, sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
workspace = sys.argv[3]
messages = [{"role": "user", "content": open(sys.argv[4]).read()}]
for _ in range(2):
    reply = client.chat.completions.create(model="any", messages=messages, max_tokens=64)
    message = reply.choices[0].message
    messages.append({"role": "assistant", "content": message.content})
    messages.append({"role": "user", "content": "continue"})
open(os.path.join(workspace, "a.txt"), "w").write("alpha\\n")
"""


def test_an_external_harness_is_recorded_like_the_builtin_one(tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(EXTERNAL_AGENT)

    def policy(text: str) -> str:
        return f"reply number {len(re.findall('<[|]im_start[|]>assistant', text))}"

    with scripted_stack(str(tmp_path), policy) as stack:
        [outcome] = _dispatch(
            stack,
            [two_file_problem("external")],
            tmp_path,
            harness_command=[
                sys.executable,
                str(agent),
                "{base_url}",
                "{api_key}",
                "{workspace}",
                "{instruction_file}",
            ],
        )
        calls = stack.calls(outcome.execution_id)
        table = Store(stack.store_config).read_table("executions")
        row = table.filter(pc.equal(table["execution_id"], outcome.execution_id)).to_pylist()[0]
    assert outcome.status == "completed" and outcome.reward == 0.5 and outcome.calls == 2
    assert row["harness"] == Path(sys.executable).name
    assert [r["role"] for r, _ in calls] == ["main", "main"]
    assert calls[1][1][: len(calls[0][1])] == calls[0][1]  # the second prompt extends the first exactly
    assert "reply number 1" in stack_tokenizer_decode(calls[1][1])
    assert json.loads(json.dumps(outcome.grade)) == {"passed": 1, "total": 2}


def test_gyre_rollout_prints_status_reward_and_branches_of_each_execution(tmp_path, capsys):
    from cli.main import main

    def policy(text: str) -> str:
        if turns(text) == 0:
            return tool_call("list_files", path=".")
        return tool_call("finish", summary="looked")

    with scripted_stack(str(tmp_path), policy) as stack:
        code = main(
            [
                "rollout", "--suite", "terminal", "--n", "2", "--timeout", "60",
                "--gateway", stack.url, "--admin-token", ADMIN_TOKEN,
                "--data-root", stack.store_config.data_root, "--campaign", stack.store_config.campaign,
            ]
        )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("s0-terminal-")]
    assert len(lines) == 2 and all(" completed " in line and " final " in line for line in lines)
    assert "2 executions: {'completed': 2}" in out


def test_an_external_harness_is_recorded_by_its_program():
    from environments.runner import harness_name

    assert harness_name(None) == "builtin"
    assert harness_name(["/opt/venv/bin/my-agent", "--base-url", "x"]) == "my-agent"
    assert harness_name(["bash", "-c", "A=1 B=2 python agent.py"]) == "python"
    script = "cd {workspace} && MSWEA_CONFIGURED=1 LITELLM_LOCAL_MODEL_COST_MAP=True /tmp/msa/bin/mini -m x"
    assert harness_name(["bash", "-c", script]) == "mini"
    assert harness_name(["sh", "-c", "cd /w; export X=1; exec ./run.sh"]) == "run.sh"


def test_runs_that_differ_only_in_run_id_get_the_same_work_when_asked(tmp_path):
    """same_work_across_runs keys the turn budgets by step, problem and member, so two policies
    compared on one gateway (different run ids) get the same long executions; by default the run id
    is part of the key and the draws differ."""

    def policy(text: str) -> str:
        return tool_call("finish", summary="done")

    durations = DurationProfile(short_turns=2, long_fraction=0.5, long_factor=(3.0, 6.0))
    budgets = {}
    with scripted_stack(str(tmp_path), policy) as stack:
        for same in (True, False):
            for run_id in ("colocate", "elastic"):
                outcomes = _dispatch(
                    stack,
                    [two_file_problem("work")],
                    tmp_path / f"{same}-{run_id}",
                    group_size=8,
                    run_id=f"{run_id}-{same}",
                    durations=durations,
                    same_work_across_runs=same,
                )
                budgets[same, run_id] = [o.turn_budget for o in outcomes]
    assert budgets[True, "colocate"] == budgets[True, "elastic"]
    assert len(set(budgets[True, "colocate"])) > 1  # some long, some short: a real draw
    assert budgets[False, "colocate"] != budgets[False, "elastic"]


def test_gyre_sim_fits_its_suites_on_a_real_stores_executions(tmp_path):
    """`gyre sim --suites-from CAMPAIGN` (cli/schedule.py recorded_suites) reads the executions and
    calls a dispatch recorded and fits one suite per harness: a three-call execution, three turns."""
    from cli.schedule import recorded_suites

    script = [
        tool_call("write_file", path="a.txt", content="alpha\n"),
        tool_call("run", command="sleep 0.2; echo beta > b.txt"),
        tool_call("finish", summary="both written"),
    ]

    def policy(text: str) -> str:
        return script[min(turns(text), len(script) - 1)]

    with scripted_stack(str(tmp_path), policy) as stack:
        _dispatch(stack, [two_file_problem("fit")], tmp_path, group_size=2)
        store = stack.store_config
    (suite,) = recorded_suites(store.data_root, store.campaign)
    assert suite.weight == 1.0 and suite.turns_median == pytest.approx(3.0) and suite.turns_sigma == 0.0
    assert suite.output_tokens_per_turn > 0 and suite.context_tokens_per_turn > 0  # tool results
    assert suite.gap_median_s > 0.0  # between calls: the tools ran (one of them sleeps 0.2 s)
