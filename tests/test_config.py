"""The campaign config refuses what it does not know, naming where and the nearest valid key."""

from __future__ import annotations

import pytest

from flows.config import CampaignConfig, unknown_keys


def test_a_typo_beside_the_real_key_is_refused_with_the_nearest_name(tmp_path):
    path = tmp_path / "typo.toml"
    path.write_text("steps = 8\nstep = 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'step' in the top level .*did you mean 'steps'"):
        CampaignConfig.from_toml(path)


def test_nested_sections_are_checked_down_to_the_sandbox_limits(tmp_path):
    path = tmp_path / "nested.toml"
    path.write_text("[dispatch]\ngroup_sise = 4\n[dispatch.harness.limits]\ncpu = 3\n")
    with pytest.raises(ValueError) as caught:
        CampaignConfig.from_toml(path)
    message = str(caught.value)
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
