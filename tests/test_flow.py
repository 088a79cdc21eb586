"""The demo flow on a real Prefect (test harness): tasks run, results are typed, reruns are idempotent."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from flows.config import CampaignConfig


@pytest.mark.slow
def test_store_demo_flow_runs_and_reruns_idempotently(prefect_harness, tmp_path):
    from flows.demo import store_demo

    config = CampaignConfig.from_toml("configs/demo.toml")
    config.store.data_root = str(tmp_path / "data")
    first = store_demo(config)
    assert first.imported.calls == 55 and first.imported.quarantined == 0
    assert first.trees.prompts_verified == first.imported.calls
    assert first.trees.unique_tokens == first.imported.unique_tokens
    assert first.imported.naive_tokens > 3 * first.trees.unique_tokens
    assert first.selection.selected == sum(first.selection.by_role.values()) > 0
    assert first.packed.target_tokens == first.selection.training_tokens
    assert os.path.exists(first.packed.uri)
    weights = first.examples["training tokens and weights per execution"]
    assert all(abs(row[2] - 1.0) < 1e-6 for row in weights.rows)

    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "data" / "campaigns") for f in fs)
    second = store_demo(config)  # a rerun (or a retried flow) rewrites the same objects
    again = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "data" / "campaigns") for f in fs)
    assert again == files
    assert second.stats.rows == first.stats.rows


def test_campaign_config_loads_and_rejects_bad_values(tmp_path):
    config = CampaignConfig.from_toml("configs/demo.toml")
    assert config.selection.j_max == 5 and config.store.campaign == "demo"
    bad = tmp_path / "bad.toml"
    bad.write_text('[selection]\nrole_priority = ["main", "boss"]\n')
    with pytest.raises(ValueError, match="unknown roles"):
        CampaignConfig.from_toml(bad)
    bad.write_text("[selection\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        CampaignConfig.from_toml(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CampaignConfig.from_toml(tmp_path / "missing.toml")


def test_every_shipped_config_loads():
    """configs/ (the recipes and the validation experiments the README cites) stay valid configs."""
    paths = sorted(Path("configs").rglob("*.toml"))
    assert len(paths) >= 8
    for path in paths:
        config = CampaignConfig.from_toml(path)
        # ./models/tiny-rec, tiny-give-up: what the README's `gyre model sft --recovery-share` and
        # `--give-up-share` commands make (the shipped tiny-give-up and tiny-give-up-half: their output)
        shipped = ("data/policies/tiny-sft", "data/policies/tiny-give-up", "data/policies/tiny-give-up-half")
        assert config.policy in (*shipped, "./models/tiny-rec", "./models/tiny-give-up"), path


def test_every_shipped_policy_is_small_and_its_readme_gives_its_sha256_and_command():
    folders = sorted(p for p in Path("data/policies").iterdir() if p.is_dir())
    assert len(folders) >= 3
    for folder in folders:
        weights = folder / "model.safetensors"
        assert weights.stat().st_size <= 8 * 2**20, folder
        readme = (folder / "README.md").read_text()
        assert hashlib.sha256(weights.read_bytes()).hexdigest() in readme, folder
        assert "gyre model sft" in readme, folder
