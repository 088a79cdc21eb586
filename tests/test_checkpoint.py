"""Checkpoints resume exactly (weights, optimizer, step); published policies carry their version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engines.model.loading import load_tokenizer
from engines.model.weights import load_model, read_weights
from engines.train.config import TrainerConfig
from engines.train.core import CoreTrainer
from tests.train_fixtures import tiny_model

pytestmark = pytest.mark.slow

SHIPPED = str(Path(__file__).resolve().parents[1] / "data" / "policies" / "tiny-sft")


def gradient(core: CoreTrainer, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(sum(p.numel() for p in core.params), generator=generator)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_checkpoint_resumes_weights_optimizer_and_step(tmp_path, zero_stage):
    config = TrainerConfig(lr=1e-2, zero_stage=zero_stage)
    core = CoreTrainer(tiny_model(3), config)
    core.apply(gradient(core, 0))
    core.save_checkpoint(str(tmp_path / "ck"))
    assert (tmp_path / "ck" / "hf" / "config.json").exists()
    assert (tmp_path / "ck" / "hf" / "model.safetensors").exists()

    # other initial weights: everything must come from the checkpoint
    resumed = CoreTrainer(tiny_model(4), config)
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert (resumed.step, resumed.version) == (1, 1)
    for name, value in core.weights().items():
        torch.testing.assert_close(resumed.weights()[name], value, rtol=0, atol=0)
    # the optimizer state came back too: the same next step gives the same weights
    core.apply(gradient(core, 1))
    resumed.apply(gradient(resumed, 1))
    for name, value in core.weights().items():
        torch.testing.assert_close(resumed.weights()[name], value, rtol=1e-6, atol=1e-7)


def test_published_policy_is_versioned(tmp_path):
    core = CoreTrainer(tiny_model(5), TrainerConfig(zero_stage=0))
    core.apply(gradient(core, 2))
    published = core.publish(str(tmp_path / "store"), fast_dir=str(tmp_path / "fast"))
    assert published.version == 1
    assert published.uri.endswith("policy/v1/model.safetensors")
    assert (tmp_path / "store" / "policy" / "v1" / "config.json").exists()
    state, version = read_weights(published.local_path, expected_version=1)
    assert version == 1
    model = tiny_model(6)
    model.load_state_dict(state, strict=False)
    for name, value in core.weights().items():
        torch.testing.assert_close(model.state_dict()[name], value)
    with pytest.raises(ValueError, match="holds policy version 1, expected 2"):
        read_weights(published.uri, expected_version=2)


def test_a_published_version_carries_its_tokenizer(tmp_path):
    """A version folder loads on its own: weights, config and the starting policy's tokenizer."""
    core = CoreTrainer(tiny_model(5), TrainerConfig(zero_stage=0))
    core.apply(gradient(core, 2))
    core.publish(str(tmp_path / "store"), fast_dir=str(tmp_path / "fast"), tokenizer_from=SHIPPED)
    folder = tmp_path / "store" / "policy" / "v1"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {
        p.name for p in folder.iterdir()
    }
    text = "Rename logs/plan.log to backup/plan.log."
    assert load_tokenizer(folder).encode(text) == load_tokenizer(SHIPPED).encode(text)
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        core.engine.module.config.to_json_string()
    )
    loaded = load_model(str(folder), dtype="float32")
    for name, value in core.weights().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)
