"""The GPU check (bench/gpu) on the CPU: it falls back to the tiny preset, every section measures or
records why it did not, and the JSON is there even when sections fail or are skipped. No timing is
asserted: the figures of a CPU run mean nothing, the script's behaviour does.

The vllm section runs apart (one vLLM engine costs 30-60 s to start here): with the vLLM environment
`make test` exports ($GYRE_VLLM_PYTHON), and without any, where it must say why it skipped."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from bench import gpu

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU machine run `bash bench/gpu_check.sh` instead"
)

# what each section's figures must hold when it ran
FIGURES = {
    "engine": "runs",
    "train": "equality_fp32",
    "deepspeed": "mean_step_s",
    "role_switch": "train_to_rollout_s",
    "migration": "runs",
}
BUT_VLLM = [name for name in gpu.SECTIONS if name != "vllm"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpu-models"))


@pytest.mark.slow
def test_cpu_fallback_runs_every_section_on_the_tiny_preset(tmp_path, models_dir):
    out = tmp_path / "gpu.json"
    copy_to = tmp_path / "device-out"
    report = gpu.main(
        str(out), budget_s=900, quick=True, models_dir=models_dir, sections=BUT_VLLM, copy_to=str(copy_to)
    )

    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(report, default=str))
    assert json.loads((copy_to / "gpu.json").read_text()) == written  # the copy_to copy
    assert written["device"] == "cpu" and written["fallback"]
    assert set(written["models"]) == {"tiny"}
    assert set(written["plan"]["engine_presets"] + written["plan"]["train_presets"]) == {"tiny"}
    assert set(written["sections"]) == set(gpu.SECTIONS)
    assert written["sections"]["vllm"] == {"status": "skipped", "reason": "not selected (--sections)"}
    for name in BUT_VLLM:
        entry = written["sections"][name]
        assert entry["status"] == "ok", (name, entry.get("error"))
        assert FIGURES[name] in entry, name
        assert entry["wall_s"] >= 0

    engine = written["sections"]["engine"]["runs"]
    assert [r["batch"] for r in engine] == [1, 4]
    for run in engine:  # same prompts, same counts: ours reuses the session prefix, HF re-reads it
        assert run["generated_tokens"] == run["batch"] * run["turns"] * written["plan"]["max_tokens"]
        assert run["ours_cached_tokens"] > 0
        assert run["ours_prefilled_tokens"] < run["prompt_tokens"]
    equality = written["sections"]["train"]["equality_fp32"]
    assert equality["max_abs_logprob_diff"] <= 1e-5  # DESIGN.md 5: fp32 tolerance
    assert equality["grad_rel_diff"] <= 1e-5
    switch = written["sections"]["role_switch"]
    assert all(c["engine_has_new_weights"] for c in switch["cycles"])
    assert [c["token_policy_version"] for c in switch["cycles"]] == [1, 2]
    migration = written["sections"]["migration"]
    assert "cuda_ipc" in migration  # the recorded reason CUDA IPC did not run here
    for run in migration["runs"]:
        assert run["recompute_prefilled_tokens"] == run["context_tokens"]
        for kind in ("shm", "ipc"):  # a moved session prefills only the next call's last token
            assert run[kind]["prefilled_after_import"] == 1
            assert run[kind]["kv_bytes"] > 0
    assert any("rollout->train" in line for line in written["summary"])

    # a rerun of one section keeps the others from the run before
    rerun = gpu.main(str(out), budget_s=900, quick=True, models_dir=models_dir, sections=["role_switch"])
    assert rerun["sections"]["role_switch"]["status"] == "ok"
    assert "from_previous_run" not in rerun["sections"]["role_switch"]
    for name in set(BUT_VLLM) - {"role_switch"}:
        assert rerun["sections"][name] == {**written["sections"][name], "from_previous_run": True}


def test_sections_out_of_budget_are_skipped_with_a_reason(tmp_path, models_dir):
    out = tmp_path / "gpu.json"
    gpu.main(str(out), budget_s=0, quick=True, models_dir=models_dir)
    sections = json.loads(out.read_text())["sections"]
    assert set(sections) == set(gpu.SECTIONS)
    for entry in sections.values():
        assert entry["status"] == "skipped"
        assert "budget" in entry["reason"]


def test_a_failing_section_is_recorded_and_the_others_still_run(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("models cannot be built under a file")
    out = tmp_path / "gpu.json"
    report = gpu.main(str(out), budget_s=600, quick=True, models_dir=str(blocked), sections=BUT_VLLM)
    assert "error" in report["models"]["tiny"]
    sections = json.loads(out.read_text())["sections"]
    assert set(sections) == set(gpu.SECTIONS)
    assert sections.pop("vllm")["reason"] == "not selected (--sections)"  # on CPU it serves no built model
    for name, entry in sections.items():  # every section was tried after the first one failed
        assert entry["status"] == "error", name
        assert "was not built" in entry["error"]


@pytest.mark.slow
@pytest.mark.xdist_group("vllm")
def test_vllm_section_starts_serves_reloads_and_sleeps_through_the_product_path(tmp_path):
    vllm_python = os.environ.get("GYRE_VLLM_PYTHON")
    assert vllm_python, (
        "GYRE_VLLM_PYTHON names vLLM's environment (make test exports it; make vllm builds it)"
    )
    out = tmp_path / "gpu.json"
    report = gpu.main(str(out), budget_s=600, quick=True, models_dir=str(tmp_path), sections=["vllm"])

    entry = json.loads(out.read_text())["sections"]["vllm"]
    assert entry["status"] == "ok", (entry.get("error"), entry.get("errors"))
    assert entry["python"] == vllm_python and entry["vllm_python"][0]["why"] is None
    assert entry["policy"] == "data/policies/tiny-sft" and entry["dtype"] == "float32"
    assert entry["start_s"] > 0
    assert entry["calls"] == 8 * entry["turns"]  # 8 sessions, each an agent loop of `turns` calls
    assert 0 < entry["output_tokens"] <= entry["calls"] * entry["max_tokens"]  # the policy may stop early
    assert entry["tokens_per_s"] > 0
    assert entry["prefix_cache_hit_ratio"] > 0  # each turn's prompt extends the last one
    assert entry["reload_policy_version"] == 1 and entry["policy_versions_after_reload"] == [1]
    assert entry["wake_policy_version"] == 2 and entry["policy_versions_after_wake"] == [2]
    assert entry["sleep_s"] >= 0 and entry["wake_s"] > 0
    assert set(entry["memory"]) == {"rss_awake_mib", "rss_asleep_mib"}  # CPU: a pause, memory kept
    assert "pauses" in entry["sleep_mode"]
    assert any(line.startswith("  vLLM ") and "wake v2" in line for line in report["summary"])


def test_vllm_section_without_a_vllm_python_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    monkeypatch.chdir(tmp_path)  # no ./.venv-vllm here; this test's python has no vllm package
    out = tmp_path / "gpu.json"
    report = gpu.main(str(out), budget_s=600, quick=True, models_dir=str(tmp_path), sections=["vllm"])

    entry = json.loads(out.read_text())["sections"]["vllm"]
    assert entry["status"] == "skipped"
    assert "no vLLM python" in entry["reason"] and "no package registry" in entry["reason"]
    assert "64 MiB" in entry["reason"]
    assert [t["source"] for t in entry["vllm_python"]] == [
        "$GYRE_VLLM_PYTHON",
        "./.venv-vllm",
        "the check's python",
    ]
    assert [t["why"] for t in entry["vllm_python"]] == [
        f"{tmp_path / 'no-such-python'} does not exist",
        f"{tmp_path / '.venv-vllm' / 'bin' / 'python'} does not exist",
        f"no vllm package in {sys.executable}",
    ]
    assert "start_s" not in entry
    assert any(line.startswith("vllm         skipped (no vLLM python") for line in report["summary"])
