"""`gyre run --check`, and what `gyre run` checks before it starts anything: the config, the policy folder
and every suite's problems, splits and ids, each mistake named with what would be right (the ids a
suite has), no traceback, no service and no data root; a campaign that would never be evaluated says
so. Real folders of problems, the shipped warm start, the real command line."""

from __future__ import annotations

from pathlib import Path

from cli.main import main
from tests.test_suites import folder_suite

ROOT = Path(__file__).resolve().parents[1]
POLICY = str(ROOT / "data" / "policies" / "tiny-sft")


def campaign_config(tmp_path: Path, suites: str, policy: str = POLICY) -> Path:
    """A campaign config beside a folder suite ``mine`` of three problems (p00, p01, p02)."""
    folder_suite(tmp_path / "mine", 3)
    path = tmp_path / "campaign.toml"
    path.write_text(
        f'name = "checked"\npolicy = "{policy}"\nsteps = 1\n[store]\ndata_root = "{tmp_path / "data"}"\n'
        f"[problems]\nper_step = 2\nsuites = {suites}\n[evaluation]\nper_suite = 1\n"
    )
    return path


def test_check_says_what_each_suite_holds_and_starts_nothing(tmp_path, cli_env, capsys):
    config = campaign_config(tmp_path, '[{ name = "mine", path = "mine", held_out = ["p00"] }, "terminal"]')
    assert main(["run", "--check", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert f"ok      config {config}: campaign checked, 1 step(s)" in out
    assert f"ok      policy {POLICY}: Qwen2ForCausalLM" in out
    assert "ok      suite mine: 3 problems, 2 to train; held out: mine-p00" in out
    assert "ok      suite terminal: generated; held out: 1 problem(s) a version" in out
    assert "ok      evaluation: 2 held-out problem(s) x 1 sample(s), at the start and at the end" in out
    assert err == ""
    assert not (tmp_path / "data").exists()  # no service, no Prefect home, no store


def test_every_mistake_is_named_with_what_is_right_and_gyre_run_starts_nothing(tmp_path, cli_env, capsys):
    suites = (
        '[{ name = "mine", path = "mine", held_out = ["p09", "mine-p01"], validation = ["p7"] },'
        ' { name = "theirs", path = "their-tasks" }]'
    )
    config = campaign_config(tmp_path, suites, policy=str(tmp_path / "no-policy"))
    for command in (["run", "--check"], ["run"]):  # gyre run checks first, and stops there
        assert main([*command, "--config", str(config)]) == 1
        out, err = capsys.readouterr()
        errors = [line for line in err.splitlines() if line.startswith("error")]
        assert errors == [
            f"error   policy {tmp_path / 'no-policy'}: no such folder",
            "error   suite mine: held_out names problems it does not have: p09; its problems are p00, p01, "
            "p02 (or with the suite's prefix, mine-p00 ...)",
            f"error   suite theirs: no such folder or file: {tmp_path / 'their-tasks'}",
        ]
        assert err.splitlines()[-1] == f"gyre run: 3 error(s) in {config}; nothing was started"
        assert "Traceback" not in out + err and "Prefect UI" not in out
    assert not (tmp_path / "data").exists()


def test_a_validation_id_it_does_not_have_and_a_suite_too_small_for_its_share_are_errors(
    tmp_path, cli_env, capsys
):
    config = campaign_config(tmp_path, '[{ name = "mine", path = "mine", validation = ["p7"] }]')
    assert main(["run", "--check", "--config", str(config)]) == 1
    assert "suite mine: validation names problems it does not have: p7; its problems are p00" in (
        capsys.readouterr().err
    )
    config = campaign_config(
        tmp_path / "small", '[{ name = "mine", path = "mine", held_out = ["p00", "p01"] }]'
    )
    assert main(["run", "--check", "--config", str(config)]) == 1
    assert "suite mine has 1 problems to train on, but a step may take 2 of it" in capsys.readouterr().err


def test_a_suite_with_nothing_held_out_is_never_evaluated_and_the_check_says_so(tmp_path, cli_env, capsys):
    config = campaign_config(tmp_path, '[{ name = "mine", path = "mine" }, "terminal"]')
    assert main(["run", "--check", "--config", str(config)]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "warning suite mine: no problem is held out, so it is never evaluated (give it held_out = [ids] or "
        "a fraction)"
    ]
    config = campaign_config(tmp_path / "alone", '[{ name = "mine", path = "mine" }]')
    assert main(["run", "--check", "--config", str(config)]) == 0
    out, err = capsys.readouterr()
    assert "ok      suite mine: 3 problems, 3 to train" in out and "ok      evaluation" not in out
    assert err.splitlines() == [
        "warning evaluation is off: no problem of any suite is held out, so no version is evaluated (give a "
        "suite held_out = [ids] or a fraction)"
    ]
