"""The campaign config refuses what it does not know, naming where and the nearest valid key, the
file and the field; and reading one is quick: it imports no Prefect, torch or model code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows.config import CampaignConfig, unknown_keys

ROOT = Path(__file__).resolve().parents[1]


def test_a_typo_beside_the_real_key_is_refused_with_the_nearest_name(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text("steps = 8\nstep = 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'step' in the top level .*did you mean 'steps'"):
        CampaignConfig.from_toml(path)


def _refused(path, text: str) -> str:
    """The error a config of ``text`` at ``path`` is refused with."""
    path.write_text(text)
    with pytest.raises(ValueError) as caught:
        CampaignConfig.from_toml(path)
    return str(caught.value)


def test_nested_sections_are_checked_down_to_the_sandbox_limits(tmp_path):
    path = tmp_path / "nested.toml"
    message = _refused(path, "[dispatch]\ngroup_sise = 4\n[dispatch.harness.limits]\ncpu = 3\n")
    assert str(path) in message
    assert "'group_sise' in [dispatch]" in message and "'group_size'" in message
    assert "'cpu' in [dispatch.harness.limits]" in message and "'cpu_s'" in message


def test_free_form_tables_and_overrides_are_not_mistaken_for_sections():
    # [scheduler] params is a table of the policy's own settings: its keys are not config keys
    config = CampaignConfig.model_validate({"scheduler": {"policy": "elastic", "params": {"depth": 2}}})
    assert config.scheduler.params == {"depth": 2.0}
    with pytest.raises(ValueError, match="'polcy' in \\[scheduler\\]"):
        CampaignConfig.from_toml("configs/demo.toml").merged({"scheduler": {"polcy": "elastic"}})


def test_a_key_far_from_every_valid_one_gets_the_list_instead_of_a_guess():
    problems = unknown_keys(CampaignConfig, {"zzzz": 1})
    assert problems and "did you mean" not in problems[0] and "valid: name" in problems[0]


HEAVY = ("torch", "prefect", "transformers", "deepspeed", "openai", "duckdb", "mlflow", "httpx")


def _in_a_fresh_interpreter(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a new Python of the venv from the checkout's root, its last stdout line being the
    heavy modules it loaded (as JSON)."""
    report = f"\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    return subprocess.run(
        [sys.executable, "-c", "import json, sys\n" + code + report],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_shipped_config_loads_without_prefect_torch_or_model_code():
    """A config is read in well under a second because reading it imports none of them (a timing
    would be flaky; the modules loaded are not)."""
    done = _in_a_fresh_interpreter(
        "from pathlib import Path\nfrom flows.config import CampaignConfig\n"
        "for path in sorted(Path('configs').glob('*.toml')):\n    CampaignConfig.from_toml(path)"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_gyre_run_reports_a_typo_naming_the_key_and_the_file_before_importing_anything_heavy(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nstep = 3\n[problems]\nper_stpe = 2\n')
    done = _in_a_fresh_interpreter(
        f"from cli.main import main\nrc = main(['run', '--config', {str(bad)!r}])\nprint(rc)"
    )
    assert done.returncode == 0, done.stderr
    *_, rc, heavy = done.stdout.splitlines()
    assert rc == "2" and json.loads(heavy) == []
    error = done.stderr
    assert error.startswith(f"gyre: error: campaign config {bad}: ") and "Traceback" not in error
    assert "unknown key 'step' in the top level" in error and "did you mean 'steps'" in error
    assert "unknown key 'per_stpe' in [problems]" in error and "did you mean 'per_step'" in error
    assert len(error.strip().splitlines()) == 2  # one line per mistake


def test_a_value_of_the_wrong_type_names_its_field_and_the_file(tmp_path):
    path = tmp_path / "types.toml"
    message = _refused(path, 'steps = "three"\n[problems]\nzero_signal = "drop"\n')
    assert message.startswith(f"campaign config {path}: ")
    assert "[steps] Input should be a valid integer" in message
    assert "[problems.zero_signal] Input should be 'skip', 'top_up' or 'keep'" in message
