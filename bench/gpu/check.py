"""The GPU check's entry: every section (or some) within a budget, the JSON, the summary lines."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

from bench.gpu.deepspeed_core import section_deepspeed
from bench.gpu.engine import section_engine
from bench.gpu.migration import section_migration
from bench.gpu.plan import SECTIONS
from bench.gpu.role_switch import section_role_switch
from bench.gpu.run import Run, quiet_transformers
from bench.gpu.train import section_train
from bench.gpu.vllm_engine import section_vllm

DEFAULT_OUT = "bench/results/gpu.json"
SECTION_FUNCTIONS: dict[str, Callable[[Run, dict, float], None]] = {
    "engine": section_engine,
    "train": section_train,
    "deepspeed": section_deepspeed,
    "role_switch": section_role_switch,
    "migration": section_migration,
    "vllm": section_vllm,
}


def summary(report: dict) -> list[str]:
    """The headline figures, one line each."""
    sections = report["sections"]
    lines = [
        f"device {report['environment'].get('device_name')} ({report['device']}), torch {report['environment']['torch']}, "
        f"wall {report.get('wall_s')} s of a {report['budget_s']} s budget"
    ]
    for name in SECTIONS:
        entry = sections.get(name, {"status": "not run"})
        error_lines = (entry.get("error") or "").strip().splitlines()
        why = entry.get("reason") or (error_lines[-1] if error_lines else "")
        if entry["status"] == "partial":
            why = "; ".join([*(f"error in {k}" for k in entry.get("errors", {})), *entry.get("skipped", [])])
        lines.append(f"{name:12s} {entry['status']}" + (f" ({why})" if why else ""))
        if name == "engine":
            for r in entry.get("runs", []):
                lines.append(
                    f"  {r['preset']:9s} batch {r['batch']:3d}: ours {r['ours_tokens_per_s']:9.1f} tok/s, "
                    f"HF {r['hf_tokens_per_s']:9.1f} tok/s ({r['speedup_vs_hf']}x), prefix hits {r['prefix_cache_hit_ratio']}"
                )
        elif name == "train":
            for r in entry.get("runs", []):
                lines.append(
                    f"  {r['preset']:9s} tree {r['tree_target_tokens_per_s']:9.1f} vs per-path "
                    f"{r['per_path_target_tokens_per_s']:9.1f} target tok/s ({r['tree_over_path_speedup']}x, "
                    f"limit {r['naive_over_unique_tokens']}x); GradWorker {r['grad_worker_over_tree']}x tree time"
                )
            if "equality_fp32" in entry:
                e = entry["equality_fp32"]
                lines.append(
                    f"  fp32 equality: max |logprob diff| {e['max_abs_logprob_diff']:.2e}, grad rel diff {e['grad_rel_diff']:.2e}"
                )
        elif name == "deepspeed" and "mean_step_s" in entry:
            lines.append(
                f"  {entry['preset']} ZeRO-2 bf16 ({entry['backend']}): step {entry['mean_step_s']} s = micro-batch "
                f"{entry['mean_micro_batch_s']} + apply {entry['mean_apply_s']} + sync {entry['mean_sync_worker_s']}; "
                f"peak {entry.get('peak_gpu_gb_in_process')} GB"
            )
        elif name == "role_switch" and "rollout_to_train_s" in entry:
            lines.append(
                f"  {entry['preset']}: rollout->train {entry['rollout_to_train_s']} s (goal 3 s: "
                f"{'met' if entry['rollout_to_train_goal_met'] else 'NOT met'}), train->rollout "
                f"{entry['train_to_rollout_s']} s (goal 1.5 s: {'met' if entry['train_to_rollout_goal_met'] else 'NOT met'})"
            )
        elif name == "migration":
            for r in entry.get("runs", []):
                moved = ", ".join(
                    f"{kind} {r[kind]['migrate_ms']} ms" for kind in ("shm", "ipc") if kind in r
                )
                lines.append(f"  {r['context_tokens']:5d} tokens: {moved}, recompute {r['recompute_ms']} ms")
        elif name == "vllm" and "start_s" in entry:
            lines.append(vllm_line(entry))
    return lines


def vllm_line(entry: dict) -> str:
    """The vllm section's figures on one line (a figure it could not measure reads '-')."""

    def get(key: str) -> Any:
        return entry.get(key, "-")

    memory = entry.get("memory", {})
    if "free_gpu_gib_asleep" in memory:
        held = (
            f"free GPU {memory['free_gpu_gib_before_sleep']} -> {memory['free_gpu_gib_asleep']} -> "
            f"{memory.get('free_gpu_gib_after_wake', '-')} GiB"
        )
    else:
        held = f"a pause on CPU, RSS {memory.get('rss_awake_mib', '-')} -> {memory.get('rss_asleep_mib', '-')} MiB"
    return (
        f"  vLLM {get('vllm')} {get('policy')} {get('dtype')}: start {get('start_s')} s, {get('tokens_per_s')} tok/s "
        f"at concurrency {get('concurrency')}, reload v1 {get('reload_s')} s (serves {get('policy_versions_after_reload')}), "
        f"sleep {get('sleep_s')} s, wake v2 {get('wake_s')} s (serves {get('policy_versions_after_wake')}; {held})"
    )


def main(
    out: str = DEFAULT_OUT,
    budget_s: float = 420.0,
    quick: bool = False,
    models_dir: str | None = None,
    sections: list[str] | None = None,
    copy_to: str | None = None,
) -> dict[str, Any]:
    """Runs every section (or only ``sections``: a rerun of some) within ``budget_s``; writes ``out``
    after every step, and the same file as ``copy_to``/gpu.json when given (a folder that outlives the
    run, so a run stopped from outside still leaves what it measured there). A rerun of some sections
    keeps the other sections' entries of an earlier ``out`` from the same kind of device, marked
    ``from_previous_run``."""
    unknown = set(sections or ()) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose among {', '.join(SECTIONS)}")
    selected = tuple(name for name in SECTIONS if sections is None or name in sections)
    previous = {}
    if sections is not None and os.path.exists(out):
        with open(out) as handle:
            previous = json.load(handle)
    quiet_transformers()
    models_dir = models_dir or os.path.join(tempfile.gettempdir(), "gyre-gpu-models")
    run = Run(out, budget_s, quick, models_dir, copy_to, selected)
    try:
        run.write()
        run.build_models()
        for name in SECTIONS:
            if name in selected:
                run.section(name, SECTION_FUNCTIONS[name])
            elif name in previous.get("sections", {}) and previous.get("device") == run.device.type:
                run.report["sections"][name] = {**previous["sections"][name], "from_previous_run": True}
            else:
                run.report["sections"][name] = {"status": "skipped", "reason": "not selected (--sections)"}
        run.report["summary"] = summary(run.report)
        run.write()
    finally:
        run.close()
    print("\n".join(run.report["summary"]))
    print(f"wrote {out}")
    return run.report
