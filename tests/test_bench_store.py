"""The storage benchmark runs end to end on the tiny sample preset and writes sane figures."""

from __future__ import annotations

import json

import pytest

from bench.store import main


@pytest.mark.slow
def test_bench_store_sample_preset_writes_sane_figures(tmp_path):
    out = tmp_path / "results" / "store.json"

    assert main(quick=True, out=str(out), preset="sample") == 0

    figures = json.loads(out.read_text())
    for key in (
        "stored_over_unique_int32",
        "naive_over_unique_tokens",
        "import_tokens_per_s",
        "naive_layout_bytes_ratio",
    ):
        assert key in figures, key
    assert figures["preset"] == "sample"
    assert figures["naive_over_unique_tokens"] > 1
    assert figures["stored_over_unique_int32"] > 0
    assert figures["weights_sum_to_one"] is True
    assert figures["naive_layout_bytes_ratio"] > 1  # our layout stores fewer bytes than the naive one
    assert all(figures["consistency"].values()), figures["consistency"]
    # the snapshot section: a group of executions of one problem shares its template's blobs
    assert figures["snapshot_group_size"] == 8 and figures["snapshot_dedup_ratio"] > 1
    assert 0 < figures["snapshot_bytes_over_targz"] < figures["snapshot_first_bytes_over_targz"]
    assert figures["snapshot_dedup_saved"] == pytest.approx(1 - 1 / figures["snapshot_dedup_ratio"])
