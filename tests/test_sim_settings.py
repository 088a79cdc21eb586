"""`gyre sim --set key=value`: presets changed field by field, with clear errors; and the role
timeline image a scheduled campaign shows in the UI."""

from __future__ import annotations

import json

import pytest

from cli.main import main as gyre
from sim.presets import CPU_SMALL, PAPER_FLAGSHIP, with_settings
from tasks.report import role_timeline_png
from tests.test_sim import COMPARED_POLICIES


def test_settings_change_fields_parts_and_the_elastic_policy():
    changed = with_settings(
        PAPER_FLAGSHIP,
        [
            "steps=8",
            "cluster.cells=512",
            "trainer.tokens_per_s=8000",
            "to_train_s=20",
            "elastic.min_dwell_s=300",
            "elastic.lend_core=false",
        ],
    )
    assert PAPER_FLAGSHIP.elastic["lend_core"] is True and changed.elastic["lend_core"] is False
    assert (changed.steps, changed.cluster.cells, changed.trainer.tokens_per_s) == (8, 512, 8000.0)
    assert changed.to_train_s == 20.0 and changed.elastic["min_dwell_s"] == 300.0
    assert changed.cluster.devices_per_cell == PAPER_FLAGSHIP.cluster.devices_per_cell
    assert with_settings(CPU_SMALL, ["async_splits=1,3"]).async_splits == (1, 3)
    for bad, message in [
        ("steps", "expected key=value"),
        ("bogus=1", "has no field 'bogus'"),
        ("cluster.bogus=1", "cluster has no field 'bogus'"),
        ("steps=many", "not a int"),
    ]:
        with pytest.raises(ValueError, match=message):
            with_settings(PAPER_FLAGSHIP, [bad])


def test_gyre_sim_prints_and_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert gyre(["sim", "--preset", "cpu-small", "--set", "steps=3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cpu-small: 3 steps" in printed and "elastic over async" in printed
    figures = json.loads(out.read_text())
    assert figures["steps"] == 3 and set(figures["policies"]) == COMPARED_POLICIES


def test_role_timeline_is_a_png():
    samples = [
        {"wall": 100.0, "roles": {"cell-0": "rollout", "cell-1": "rollout"}, "switching": []},
        {"wall": 104.0, "roles": {"cell-0": "train", "cell-1": "rollout"}, "switching": ["cell-1"]},
        {"wall": 109.0, "roles": {"cell-0": "train", "cell-1": "train"}, "switching": []},
    ]
    png = role_timeline_png(samples, [(108.0, 0)])
    assert png.startswith(b"\x89PNG") and len(png) > 1000
