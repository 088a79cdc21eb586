"""vLLM's own server as a child process of the adapter: its command line, its environment, its start.

    child = VllmProcess(config, port=free_port())   # starts `python -m vllm.entrypoints.openai.api_server`
    await child.wait_healthy(client)                # its /health answers (start-up takes 30-60 s on CPU)
    child.stop()

Nothing of ours runs inside that process: it is vLLM's unmodified OpenAI server, started with dev mode
on (VLLM_SERVER_DEV_MODE=1: /collective_rpc, /sleep, /wake_up, /reset_prefix_cache, /pause, /resume),
prefix caching and prompt-token details on, raw logprobs (log-softmax of the logits before temperature,
top-k, top-p: what the trainer recomputes) and vLLM's own sampling defaults rather than the model's
generation_config.json (the gateway sends every sampling field it means). The child dies with the
adapter (PR_SET_PDEATHSIG), and the adapter with the child (server.py watches it).

Threads: a CPU build binds its OpenMP threads to cores by default (one core, another reserved), so two
engines on one host would share a core. The adapter passes its own CPU budget down instead: the cores
it may run on (its affinity, when narrower than the host's) as VLLM_CPU_OMP_THREADS_BIND, else no
binding and OMP_NUM_THREADS as the spawner set it. CUDA_VISIBLE_DEVICES passes through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engines.vllm.config import VllmServerConfig
from engines.vllm.settings import thread_budget

_PR_SET_PDEATHSIG = 1


def vllm_command(config: VllmServerConfig, port: int) -> list[str]:
    """The vLLM server's command line."""
    command = [
        config.vllm_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        config.model,
        "--served-model-name",
        config.served_model_name,
        "--dtype",
        config.dtype,
        "--seed",
        str(config.seed),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--logprobs-mode",
        "raw_logprobs",
        "--generation-config",
        "vllm",
        "--tensor-parallel-size",
        str(config.tensor_parallel_size),
        "--gpu-memory-utilization",
        str(config.gpu_memory_utilization),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
    ]
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    if config.enforce_eager:
        command.append("--enforce-eager")
    gpu = gpu_driver_present()
    if config.sleep_mode if config.sleep_mode is not None else gpu:
        command.append("--enable-sleep-mode")
    if not gpu and "--max-num-batched-tokens" not in config.extra_args:
        # vLLM 0.32's CPU build kills its engine core when a seeded request's prefill is split in
        # chunks ("CPU Generator does not use offset", gpu_model_runner._bookkeeping_sync): a prompt
        # longer than the batch budget (2,048 tokens here) with a seed, which every rollout call has.
        # A budget of the whole model length keeps every prefill in one chunk.
        command += ["--max-num-batched-tokens", str(model_length(config))]
    return command + list(config.extra_args)


def model_length(config: VllmServerConfig) -> int:
    """The longest sequence the engine serves: max_model_len, else the model's max_position_embeddings."""
    if config.max_model_len is not None:
        return config.max_model_len
    model = json.loads((Path(config.model) / "config.json").read_text())
    return int(model.get("max_position_embeddings") or 8192)


def gpu_driver_present() -> bool:
    """Whether this host has a GPU driver vLLM's sleep mode runs on (CUDA or ROCm)."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists()


def vllm_env(config: VllmServerConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the adapter's (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS as the spawner set
    them), dev mode on, the CPU KV cache size and the CPU thread binding."""
    env = {**os.environ} if base is None else dict(base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(config.kv_cache_gib)))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding())
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def cpu_binding() -> str:
    """VLLM_CPU_OMP_THREADS_BIND for this process's CPU budget: its cores when it was given fewer than
    the host has (and no more than OMP_NUM_THREADS of them), else 'nobind'."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) >= (os.cpu_count() or len(mine)):
        return "nobind"
    threads = thread_budget() or len(mine)
    return ",".join(str(core) for core in mine[: max(1, threads)])


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class VllmExited(RuntimeError):
    """vLLM's process ended before it answered /health."""


class VllmProcess:
    """vLLM's server, started now on 127.0.0.1:``port``; its output goes to the adapter's stderr."""

    def __init__(self, config: VllmServerConfig, port: int):
        self.config, self.port = config, port
        self.url = f"http://127.0.0.1:{port}"
        self.command = vllm_command(config, port)
        self.process = subprocess.Popen(
            self.command,
            env=vllm_env(config),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            stderr=sys.stderr,
            preexec_fn=_die_with_parent,
            start_new_session=True,
        )

    async def wait_healthy(self, client: httpx.AsyncClient) -> float:
        """Seconds until vLLM answered /health; RuntimeError if it exited or took too long."""
        start = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise VllmExited(
                    f"vLLM exited with {self.process.returncode} while starting: {' '.join(self.command)} "
                    "(its log is above)"
                )
            try:
                if (await client.get(f"{self.url}/health", timeout=2)).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            if time.monotonic() - start > self.config.start_timeout_s:
                raise RuntimeError(f"vLLM did not answer /health within {self.config.start_timeout_s:.0f} s")
            await asyncio.sleep(0.5)

    def stop(self) -> None:
        """Terminates vLLM's process group (its engine core and workers too)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
