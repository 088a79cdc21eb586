"""The `gyre` command line: help, the exact JSONL round trip, per-execution stats checked against a
plain Python trie of the file's sequences, SQL output formats and errors, and the deterministic
sample generator. Store commands run without Prefect (the CLI calls the tasks' plain functions)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from tests.campaign_fixtures import tracked_steps
from tests.records import assert_same_records, record_key
from trajectory_store.storage import Store

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample_trace.jsonl"
STATS_FIELDS = (
    "n_calls",
    "n_naive_tokens",
    "n_unique_tokens",
    "n_policy_tokens",
    "n_trajectories",
    "n_selected",
    "bytes_stored",
)
J_MAX = 5  # SelectionConfig's default


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    """The CLI reads defaults from the environment and sets PREFECT_HOME: keep both inside the test."""
    monkeypatch.delenv("GYRE_DATA_ROOT", raising=False)
    monkeypatch.delenv("GYRE_CAMPAIGN", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))


@pytest.fixture
def imported(tmp_path, cli_env, capsys) -> list[str]:
    """The sample trace imported through the CLI; returns the store options to pass to later commands."""
    store_args = ["--data-root", str(tmp_path / "data"), "--campaign", "cli"]
    assert main(["traj", "import", str(SAMPLE), *store_args]) == 0
    out = capsys.readouterr().out
    assert "4 executions, 55 calls" in out
    return store_args


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["--help"])

    assert raised.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "traj", "sql", "bench"):
        assert command in out.split(), command


def test_gyre_entry_point_runs_as_a_program():
    gyre = Path(sys.executable).parent / "gyre"

    done = subprocess.run([str(gyre), "--help"], capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    assert "traj" in done.stdout


def test_import_then_export_round_trip_is_exact(imported, tmp_path, capsys):
    out = tmp_path / "export.jsonl"

    assert main(["traj", "export", str(out), *imported]) == 0

    assert "4 executions, 55 calls" in capsys.readouterr().out
    original, exported = read_jsonl(SAMPLE), read_jsonl(out)
    assert [record_key(r) for r in exported] == sorted(map(record_key, original), key=lambda k: (k[1], k[2]))
    assert_same_records(original, exported)
    by_key = {record_key(r): r for r in exported}
    for want in original:  # ints stay ints
        got = by_key[record_key(want)]
        ints = [name for name, value in want.items() if type(value) is int]
        assert all(type(got[name]) is int for name in ints), (record_key(want), ints)


def trie_figures(calls: list[dict]) -> dict[str, int]:
    """Nodes, policy nodes, leaves and selectable leaves of a dict trie of one execution's sequences."""
    root: dict = {}
    policy: set[int] = set()  # id() of nodes that some call generated
    for call in calls:
        node = root
        n_prompt = len(call["prompt_ids"])
        for depth, token in enumerate(call["prompt_ids"] + call["output_ids"]):
            node = node.setdefault(token, {})
            if depth >= n_prompt:
                policy.add(id(node))
    nodes = leaves = selectable = 0
    stack = [(child, id(child) in policy) for child in root.values()]
    while stack:
        node, path_has_policy = stack.pop()
        nodes += 1
        if not node:
            leaves += 1
            selectable += path_has_policy
        stack.extend((child, path_has_policy or id(child) in policy) for child in node.values())
    return {"nodes": nodes, "policy": len(policy), "leaves": leaves, "selectable": selectable}


def test_stats_json_matches_a_python_trie_of_the_file(imported, capsys):
    assert main(["traj", "stats", "--format", "json", *imported]) == 0

    stats = {row["execution_id"]: row for row in json.loads(capsys.readouterr().out)}
    records = read_jsonl(SAMPLE)
    assert sorted(stats) == sorted({r["execution_id"] for r in records})
    for execution_id, row in stats.items():
        calls = [r for r in records if r["type"] == "call" and r["execution_id"] == execution_id]
        trie = trie_figures(calls)
        assert set(STATS_FIELDS) <= set(row), row
        assert row["n_calls"] == len(calls)
        assert row["n_naive_tokens"] == sum(len(c["prompt_ids"]) + len(c["output_ids"]) for c in calls)
        assert row["n_unique_tokens"] == trie["nodes"], execution_id
        assert row["n_policy_tokens"] == trie["policy"], execution_id
        assert row["n_trajectories"] == trie["leaves"], execution_id
        assert row["n_selected"] == min(J_MAX, trie["selectable"]), execution_id  # every status is trainable
        assert row["bytes_stored"] > 4 * row["n_unique_tokens"]


COUNT_SQL = "SELECT execution_id, count(*) AS n_calls FROM calls GROUP BY ALL ORDER BY execution_id"
EXPECTED_COUNTS = [("p0-e0", 13), ("p0-e1", 16), ("p1-e0", 16), ("p1-e1", 10)]


def test_sql_csv(imported, capsys):
    assert main(["sql", *imported, "--format", "csv", COUNT_SQL]) == 0

    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["execution_id", "n_calls"]
    assert [(e, int(n)) for e, n in rows[1:]] == EXPECTED_COUNTS


def test_sql_table(imported, capsys):
    assert main(["sql", *imported, "--format", "table", COUNT_SQL]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["execution_id", "n_calls"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert [tuple(line.split()) for line in lines[2:6]] == [(e, str(n)) for e, n in EXPECTED_COUNTS]
    assert lines[6] == "(4 rows)"


@pytest.mark.parametrize(
    ("query", "culprit"),
    [
        ("SELECT * FROM no_such_view", "no_such_view"),
        ("SELEC 1", "SELEC"),
        ("SELECT nope FROM calls", "nope"),
    ],
    ids=["unknown-view", "syntax", "unknown-column"],
)
def test_sql_error_exits_2_with_a_message_not_a_traceback(imported, capsys, query, culprit):
    try:
        code = main(["sql", *imported, query])
    except Exception as error:  # a traceback is what the user would see
        pytest.fail(f"gyre sql raised {type(error).__name__} instead of exiting 2: {error}")

    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("gyre: ") and "Traceback" not in err
    assert culprit in err  # it names what was wrong


def test_sample_preset_regenerates_the_bundled_trace(tmp_path, cli_env, capsys):
    out = tmp_path / "sample.jsonl"

    assert main(["traj", "sample", str(out), "--preset", "sample"]) == 0

    assert out.read_bytes() == SAMPLE.read_bytes()


def test_the_cli_has_the_gateway_engine_and_bench_commands():
    from cli.main import build_parser
    from engines.gateway import settings as gateway_settings
    from engines.rollout import settings as engine_settings

    parser = build_parser()
    assert parser.parse_args(["bench", "engine", "--quick"]).bench_command == "engine"
    args = parser.parse_args(["gateway", "--model", "m", "--engine", "http://a", "--engine", "http://b"])
    gateway = gateway_settings.config_from_args(args)
    assert [e.url for e in gateway.engines] == ["http://a", "http://b"] and gateway.host == "127.0.0.1"
    assert engine_settings.config_from_args(parser.parse_args(["engine", "--model", "m"])).port == 8100


def test_every_option_of_every_command_has_help_and_names_its_default(capsys):
    from cli.main import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])
            elif action.option_strings and action.dest != "help":
                yield path, action, parser

    for path, action, parser in walk(build_parser(), []):
        where = f"gyre {' '.join(path)} {action.option_strings[0]}"
        assert action.help, where
        text = parser.formatter_class(prog="gyre")._expand_help(action) if action.help else ""
        flag = action.nargs == 0 or action.required
        assert flag or "default" in text or "required" in text, where


def test_traj_stats_on_an_empty_campaign_names_the_campaigns_that_exist(imported, capsys):
    data_root = imported[1]

    assert main(["traj", "stats", "--data-root", data_root]) == 0  # campaign 'default': nothing there

    captured = capsys.readouterr()
    assert "(0 rows)" in captured.out
    assert "campaign 'default'" in captured.err and "campaigns there: cli" in captured.err
    assert "--campaign cli" in captured.err


def test_execution_register_and_finish_speak_the_gateways_admin_api(tmp_path, cli_env, capsys):
    from tests.scripted_engine import scripted_stack
    from tests.test_gateway_fixtures import ADMIN_TOKEN

    with scripted_stack(str(tmp_path), lambda text: "hello there") as stack:
        gateway = ["--gateway", stack.url, "--admin-token", ADMIN_TOKEN]
        assert main(["execution", "register", "--problem-id", "p-1", "--step", "2", *gateway]) == 0
        out = capsys.readouterr().out
        execution_id = re.search(r"registered execution (\S+) at step 2", out).group(1)
        base_url = re.search(r"base_url  (\S+)", out).group(1)
        api_key = re.search(r"api_key   (\S+)", out).group(1)
        client = stack.client({"base_url": base_url, "api_key": api_key})
        answer = client.chat.completions.create(
            model="gyre-policy", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert answer.choices[0].message.content == "hello there"

        assert (
            main(["execution", "finish", execution_id, "--status", "completed", "--reward", "1", *gateway])
            == 0
        )
        finished = capsys.readouterr().out
        again = main(
            ["execution", "finish", execution_id, "--status", "completed", "--reward", "1", *gateway]
        )
        refused = capsys.readouterr().err
        assert main(["execution", "register", "--execution-id", execution_id, *gateway]) == 2
        conflict = capsys.readouterr().err
        assert main(["execution", "register", "--format", "env", *gateway]) == 0
        exports = capsys.readouterr().out
        calls = stack.calls(execution_id)
        executions = Store(stack.store_config).read_table("executions").to_pylist()

    store = stack.store_config
    assert (
        f"finished execution {execution_id} (completed, reward 1): 1 calls; recorded to {store.data_root}"
        in finished
    )
    assert f"(campaign {store.campaign}, step 2)" in finished
    assert [row["step"] for row, _ in calls] == [2]
    (row,) = [e for e in executions if e["execution_id"] == execution_id]
    assert (row["problem_id"], row["harness"], row["reward"], row["status"]) == (
        "p-1",
        "external",
        1.0,
        "completed",
    )
    assert again == 2 and refused.startswith("gyre: error: ") and "Traceback" not in refused
    assert "409" in conflict and "already finished" in conflict
    assert [line.split("=")[0] for line in exports.splitlines()] == [
        "export GYRE_EXECUTION_ID",
        "export OPENAI_BASE_URL",
        "export OPENAI_API_KEY",
    ]


def test_gyre_rollout_twice_on_one_gateway_records_both_runs_and_a_reused_run_id_is_one_error_line(
    tmp_path, cli_env, capsys
):
    from tests.scripted_engine import scripted_stack, tool_call
    from tests.test_gateway_fixtures import ADMIN_TOKEN

    with scripted_stack(str(tmp_path), lambda text: tool_call("finish", summary="done")) as stack:
        store = stack.store_config
        command = ["rollout", "--suite", "terminal", "--n", "2", "--timeout", "60", "--gateway", stack.url]
        command += [
            "--admin-token",
            ADMIN_TOKEN,
            "--data-root",
            store.data_root,
            "--campaign",
            store.campaign,
        ]
        assert main(command) == 0
        first = capsys.readouterr().out
        assert main(command) == 0
        second = capsys.readouterr().out
        assert main([*command, "--run-id", "fixed"]) == 0
        capsys.readouterr()
        try:
            code = main([*command, "--run-id", "fixed"])
        except Exception as error:  # a traceback is what the user would see
            pytest.fail(f"a rerun raised {type(error).__name__}: {error}")
        rerun = capsys.readouterr()
        executions = Store(store).read_table("executions")["execution_id"].to_pylist()

    rows = [
        [line.split()[0] for line in out.splitlines() if line.startswith("s0-terminal-")]
        for out in (first, second)
    ]
    assert all(len(ids) == 2 for ids in rows) and not set(rows[0]) & set(rows[1])
    for out in (first, second):
        assert out.splitlines()[0].split()[:2] == ["execution", "status"]  # the header comes first
        assert f"recorded to {store.data_root} (campaign {store.campaign}, step 0)" in out.splitlines()[-1]
    fixed = [e for e in executions if e.endswith("-g0-fixed")]
    assert sorted(executions) == sorted([*rows[0], *rows[1], *fixed]) and len(fixed) == 2
    assert code == 2 and "Traceback" not in rerun.err
    (line,) = rerun.err.strip().splitlines()
    assert line.startswith("gyre: error: ") and "already finished" in line and "--run-id" in line


@pytest.mark.slow
def test_gyre_run_starts_the_services_runs_a_campaign_and_gyre_down_stops_them(tmp_path):
    """As a user runs it: the installed `gyre` program, in its own process."""
    from engines.model import ModelConfig, init_model

    policy = tmp_path / "policy"
    init_model(ModelConfig(preset="tiny", seed=0), str(policy))
    config = tmp_path / "campaign.toml"
    config.write_text(
        f'name = "clirun"\npolicy = "{policy}"\nsteps = 1\n[store]\ndata_root = "{tmp_path / "data"}"\n'
        '[problems]\nsuites = ["terminal"]\nper_step = 1\n[evaluation]\nper_suite = 1\n'
        "[dispatch]\ngroup_size = 2\ntimeout_s = 60\n[dispatch.durations]\nshort_turns = 1\nlong_fraction = 0.0\n"
        "[dispatch.harness]\nmax_tokens = 16\nmax_retries = 0\nmax_subagents = 0\n[serving]\ntrainer_threads = 1\n"
    )
    gyre = str(Path(sys.executable).parent / "gyre")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [gyre, *args], capture_output=True, text=True, env=env, timeout=900, check=False
        )

    ports = ["--prefect-port", "0", "--gateway-port", "0", "--engine-port", "0"]
    try:
        done = run("run", "--config", str(config), *ports)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("Prefect UI: http://127.0.0.1:")
        assert "held-out version 1: pass rate" in done.stdout and "campaign clirun: 1 steps" in done.stdout
        assert re.search(r"held-out gain -?[\d.]+ \(95% CI \[.*\], paired over 1 problems", done.stdout)
        assert "steps committed" in done.stderr  # the progress line
        # the campaign left an MLflow run and TensorBoard events, and gyre run said how to open them
        tracking = tmp_path / "data" / "tracking"
        assert f"--backend-store-uri sqlite:///{tracking / 'mlflow.db'}" in done.stdout
        assert f"--logdir {tracking / 'tensorboard'}" in done.stdout
        steps = tracked_steps(tracking, "clirun", ["train/reward", "eval/pass_rate"])
        assert steps == {"train/reward": ([0], [0]), "eval/pass_rate": ([0, 1], [0, 1])}
        status = run("status", "--config", str(config))
        assert status.returncode == 0, status.stdout
        assert all(name in status.stdout for name in ("prefect", "engine-0", "gateway"))
    finally:
        down = run("down", "--config", str(config))
    assert "stopped gateway, engine-0, prefect" in down.stdout
    assert "no services of gyre up" in run("status", "--config", str(config)).stdout


def test_deploy_and_worker_without_a_server_say_how_to_get_one(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    for command in (["deploy"], ["worker"]):
        assert main([*command, "--data-root", str(tmp_path / "nowhere")]) == 2
        err = capsys.readouterr().err
        assert "no Prefect server: set PREFECT_API_URL, or start one with `gyre up`" in err


def test_the_progress_line_names_a_held_out_evaluation_while_it_runs(tmp_path):
    """Before a step's first execution, the line counts the held-out evaluation of that version."""
    from cli.campaign import Progress
    from flows.config import CampaignConfig
    from trajectory_store.recorder import Recorder
    from trajectory_store.storage import StoreConfig

    config = CampaignConfig.from_toml("configs/learn-quick.toml")
    config.store.data_root = str(tmp_path)
    progress = Progress(config)
    assert progress.line().endswith("0/8 steps committed; step 0: 0/48 executions")
    recorder = Recorder(Store(StoreConfig(data_root=str(tmp_path), campaign="learn-quick-eval")), step=0)
    for n in range(5):
        recorder.record_execution(
            f"e{n}", status="completed", reward=1.0, problem_id=f"p{n}", group_id=f"g{n}"
        )
    recorder.flush()
    assert progress.line().endswith("0/8 steps committed; evaluating version 0: 5/384 held-out executions")
    recorder = Recorder(Store(StoreConfig(data_root=str(tmp_path), campaign="learn-quick")), step=0)
    recorder.record_execution("t0", status="completed", reward=0.0, problem_id="p0", group_id="g0")
    recorder.flush()  # the step has begun: its executions, not the evaluation's
    assert progress.line().endswith("0/8 steps committed; step 0: 1/48 executions, mean reward 0.00")
