"""The rollout benchmark: our engine vs Hugging Face generate, KV migration vs recompute, and the
gateway's overhead per call, measured in one run on the same model.

    gyre bench engine            # full: 16 sessions x 8 turns, migration at 2K / 8K / 32K, 320 gateway calls
    gyre bench engine --quick    # quick: 8 sessions x 6 turns, 2K / 8K, 120 gateway calls (about two minutes)
    python -m bench.engine [--quick] [--out bench/results/engine.json]

Model: the ``tiny`` preset (engines/model, 3M parameters, our tokenizer and chat template), random
weights, float32, on the CPU with ONE torch thread (on a shared 2-core host two threads were slower
and far noisier); the figures compare systems on the same model, not the model. Read ratios, not seconds.

1. Engine vs HF (bench/engine_workload.py `bench_engine`): many sessions of an agent loop whose contexts
   grow each turn (previous prompt + output + a 50-300-token tool result); all sessions' turns batched on
   our engine (prefix cache + continuous batching), then the very same prompts through HF
   ``model.generate`` one call at a time on the full context (what a simple harness would do), greedy,
   the same number of new tokens. ``engine_over_hf_speedup`` = HF seconds / our seconds;
   ``prefix_cache_hit_ratio`` = cached / (cached + prefilled) prompt tokens on our engine.
2. KV migration (`bench_migration`): export + /dev/shm transport + import of a session's KV vs prefilling
   the same context on a fresh engine, median of repeats; 2K, 8K and (full run) 32K tokens of context.
   32K uses fewer repeats (one CPU recompute takes minutes); the tiny model serves every context size.
3. Gateway overhead: a rollout engine server and the gateway each in their own process (as deployed;
   in one process they would share a GIL), driven over loopback HTTP by this process. Agent-shaped
   chats (a system prompt, then turns that each add the assistant's reply and a 30-80-word tool
   result), max_tokens=1. Each call through the gateway is followed at once by the same prompt sent
   directly to the engine (a parallel session, the same sampling fields), so each pair sees the same
   host load; the direct prompt's ids come from the gateway's own SessionContext run in this process
   and are checked afterwards against what the store recorded (``direct_prompts_identical_to_recorded``).
   ``gateway_overhead_ms_p50/p99`` = percentiles of the per-call difference (gateway latency - direct
   latency): what a harness pays for the gateway, the extra HTTP hop included.
   ``gateway_internal_ms_p50/p99`` = the gateway's own timer (arrival to last byte, minus the time it
   waited on the engine). The first calls of each execution are warm-up and excluded.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import pyarrow.compute as pc
import torch

from bench.engine_workload import bench_engine, bench_migration
from bench.figures import write_figures
from engines.admin import AdminClient
from engines.net import free_port
from engines.quantiles import quantile
from environments.gateway_admin import EXECUTIONS, finish_path
from stack.stack import serving_process

DEFAULT_OUT = "bench/results/engine.json"
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "sessions": 8,
        "turns": 6,
        "migration_contexts": [2048, 8192],
        "migration_repeats": {2048: 3, 8192: 2},
        "overhead_executions": 4,
        "overhead_turns": 30,
    },
    "full": {
        "sessions": 16,
        "turns": 8,
        "migration_contexts": [2048, 8192, 32768],
        "migration_repeats": {2048: 5, 8192: 3, 32768: 1},
        "overhead_executions": 8,
        "overhead_turns": 40,
    },
}
MODEL_PRESET = "tiny"
THREADS = 1
WARMUP_CALLS = 3  # per execution, excluded from the overhead figures
SPEEDUP_GOAL, MIGRATION_GOAL, OVERHEAD_GOAL_MS = 3.0, 5.0, 5.0
ADMIN, ENGINE_ADMIN = "bench-gateway-admin", "bench-engine-admin"
_TOOL_TEXT = (
    "the build failed because module parser could not find symbol config in file src/main.py line 42 "
    "test passed 17 of 20 assertion error expected value got none retry with flag verbose output shows "
    "stack trace from function load settings which reads environment variable path and opens json"
)
WORDS = _TOOL_TEXT.split()


def run(quick: bool) -> dict[str, Any]:
    from engines.model.build import build_model, save_model_folder
    from engines.model.config import ModelConfig
    from engines.model.tokenizer import build_tokenizer

    preset = PRESETS["quick" if quick else "full"]
    started = time.perf_counter()
    config = ModelConfig(preset=MODEL_PRESET)
    model = build_model(config, build_tokenizer(config.resolved_vocab_size()))
    figures: dict[str, Any] = {
        "preset": "quick" if quick else "full",
        "model_preset": MODEL_PRESET,
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch_threads": THREADS,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
    }
    print(f"1/3 engine vs HF generate: {preset['sessions']} sessions x {preset['turns']} turns", flush=True)
    engine = bench_engine(model, n_sessions=preset["sessions"], turns=preset["turns"], cpu_threads=THREADS)
    figures["engine_vs_hf"] = engine
    figures["engine_over_hf_speedup"] = engine["speedup"]
    figures["prefix_cache_hit_ratio"] = engine["prefix_cache_hit_ratio"]

    migration = {}
    for context in preset["migration_contexts"]:
        print(f"2/3 KV migration vs recompute at {context} tokens", flush=True)
        repeats = preset["migration_repeats"][context]
        result = bench_migration(model, context, repeats=repeats, cpu_threads=THREADS)
        migration[f"{context // 1024}k"] = {**result, "repeats": repeats}
    figures["migration"] = migration
    for key, result in migration.items():
        figures[f"migration_over_recompute_{key}"] = result["recompute_over_migrate"]
    figures["migration_note"] = (
        "the tiny preset at every context size (max_position_embeddings 32768); 32K recompute on CPU "
        "takes minutes, so it has fewer repeats"
    )

    print(
        f"3/3 gateway overhead: {preset['overhead_executions']} executions x {preset['overhead_turns']} turns",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="gyre-bench-engine-") as tmp:
        folder = os.path.join(tmp, "model")
        save_model_folder(config, folder)
        overhead = gateway_overhead(folder, tmp, preset["overhead_executions"], preset["overhead_turns"])
    figures["gateway"] = overhead
    for key in ("gateway_overhead_ms_p50", "gateway_overhead_ms_p99", "gateway_internal_ms_p50"):
        figures[key] = overhead[key]
    figures["gateway_internal_ms_p99"] = overhead["gateway_internal_ms_p99"]
    figures["goals"] = {
        "engine_over_hf_speedup >= 3": figures["engine_over_hf_speedup"] >= SPEEDUP_GOAL,
        "migration_over_recompute_8k >= 5": figures["migration_over_recompute_8k"] >= MIGRATION_GOAL,
        "gateway_overhead_ms_p50 < 5": figures["gateway_overhead_ms_p50"] < OVERHEAD_GOAL_MS,
        "gateway_overhead_ms_p99 < 5": figures["gateway_overhead_ms_p99"] < OVERHEAD_GOAL_MS,
    }
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    return figures


# gateway overhead ------------------------------------------------------------------------------------
def gateway_overhead(folder: str, tmp: str, executions: int, turns: int) -> dict[str, Any]:
    from engines.gateway.codec import ChatCodec
    from engines.gateway.context import SessionContext
    from engines.gateway.protocol import ChatCompletionRequest
    from trajectory_store.interchange import rebuild_sequences
    from trajectory_store.storage import Store, StoreConfig

    store_config = StoreConfig(data_root=os.path.join(tmp, "store"), campaign="bench")
    engine_port, gateway_port = free_port(), free_port()
    engine_url, gateway_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{gateway_port}"
    engine_cmd = [
        sys.executable,
        "-m",
        "engines.rollout.server",
        "--model",
        folder,
        "--port",
        str(engine_port),
    ]
    engine_cmd += ["--admin-token", ENGINE_ADMIN, "--engine-id", "bench-0", "--max-batch-size", "8"]
    gateway_cmd = [sys.executable, "-m", "engines.gateway", "--model", folder, "--engine", engine_url]
    gateway_cmd += ["--port", str(gateway_port), "--admin-token", ADMIN, "--engine-admin-token", ENGINE_ADMIN]
    gateway_cmd += ["--data-root", store_config.data_root, "--campaign", store_config.campaign]
    admin = {"Authorization": f"Bearer {ADMIN}"}  # the execution admin (environments/gateway_admin.py paths)
    codec = ChatCodec.from_folder(folder)
    rng = random.Random(0)
    through, direct, identical, total, last_prompt_tokens = [], [], 0, 0, 0
    with (
        _process(engine_cmd, engine_url),
        _process(gateway_cmd, gateway_url),
        httpx.Client(timeout=120) as http,
    ):
        model_name = http.get(f"{engine_url}/v1/models").json()["data"][0]["id"]
        for e in range(executions):
            execution_id = f"bench-{e}"
            body = {"execution_id": execution_id}
            registration = http.post(gateway_url + EXECUTIONS, headers=admin, json=body).json()
            headers = {"Authorization": f"Bearer {registration['api_key']}"}
            context = SessionContext(codec)  # the gateway's own prompt logic, to send the same ids direct
            messages = [
                {"role": "system", "content": "You are a coding agent. Use the tools, then answer."},
                {"role": "user", "content": "Fix the failing test in the repository."},
            ]
            expected = []
            for turn in range(turns):
                body = {"model": "gyre-policy", "messages": messages, "max_tokens": 1, "seed": turn}
                start = time.perf_counter()
                response = http.post(
                    registration["base_url"] + "/chat/completions", headers=headers, json=body
                )
                elapsed = time.perf_counter() - start
                response.raise_for_status()
                reply = response.json()["choices"][0]["message"]
                parsed = ChatCompletionRequest.model_validate({"messages": messages}).messages
                plan = context.plan([m.template_dict() for m in parsed], None)
                expected.append(plan.prompt_ids)
                same = {
                    "model": model_name,
                    "prompt": plan.prompt_ids,
                    "max_tokens": 1,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "seed": turn,
                    "stop_token_ids": codec.stop_ids,
                    "logprobs": 1,
                    "return_tokens_as_token_ids": True,
                    "return_token_ids": True,
                    "session_id": f"direct/{execution_id}",
                }
                start = time.perf_counter()
                answer = http.post(f"{engine_url}/v1/completions", json=same)
                direct_elapsed = time.perf_counter() - start
                answer.raise_for_status()
                context.commit(
                    plan, answer.json()["choices"][0]["token_ids"], {**reply, "content": reply["content"]}
                )
                if turn >= WARMUP_CALLS:
                    through.append(elapsed)
                    direct.append(direct_elapsed)
                tool = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 80)))
                messages = [*messages, reply, {"role": "user", "content": f"Tool output:\n{tool}"}]
            finish = {"status": "completed"}
            http.post(gateway_url + finish_path(execution_id), headers=admin, json=finish)
            calls = Store(store_config).read_table("calls")
            calls = calls.filter(pc.equal(calls["execution_id"], execution_id))
            for (row, sequence), ids in zip(rebuild_sequences(calls), expected, strict=True):
                identical += sequence[: row["prompt_len"]].tolist() == ids
                total += 1
                last_prompt_tokens = row["prompt_len"]
        with AdminClient(gateway_url, ADMIN) as gateway:
            internal = gateway.gateway_stats(samples=True)
    differences = sorted((g - d) * 1e3 for g, d in zip(through, direct, strict=True))
    internal_ms = sorted(
        v for i, v in enumerate(internal.gateway_overhead_ms.recent_ms or []) if i % turns >= WARMUP_CALLS
    )
    return {
        "executions": executions,
        "turns": turns,
        "calls_measured": len(differences),
        "max_tokens": 1,
        "last_prompt_tokens": last_prompt_tokens,
        "direct_prompts_identical_to_recorded": f"{identical}/{total}",
        "gateway_latency_ms_p50": round(statistics.median(through) * 1e3, 3),
        "direct_latency_ms_p50": round(statistics.median(direct) * 1e3, 3),
        "gateway_overhead_ms_p50": quantile(differences, 0.5, digits=3),
        "gateway_overhead_ms_p99": quantile(differences, 0.99, digits=3),
        "gateway_internal_ms_p50": quantile(internal_ms, 0.5, digits=3),
        "gateway_internal_ms_p99": quantile(internal_ms, 0.99, digits=3),
        "reused_prompt_tokens": internal.reused_prompt_tokens,
        "tokenized_prompt_tokens": internal.tokenized_prompt_tokens,
        "retokenized_assistant_messages": internal.retokenized_assistant_messages,
    }


def _process(command: list[str], url: str):
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    return serving_process(command, url, env)


# entry point -----------------------------------------------------------------------------------------
def main(quick: bool = False, out: str = DEFAULT_OUT) -> int:
    saved = torch.get_num_threads()
    try:
        figures = run(quick)
    finally:
        torch.set_num_threads(saved)
    engine, gateway = figures["engine_vs_hf"], figures["gateway"]
    lines = [
        f"model                                   {figures['model_preset']} ({figures['parameters']:,} parameters), "
        f"{figures['torch_threads']} torch thread",
        f"workload                                {engine['n_sessions']} sessions x {engine['turns']} turns, "
        f"{engine['generated_tokens']} tokens generated",
        f"our engine                              {engine['ours_tokens_per_s']:.1f} tokens/s",
        f"HF generate per turn, full context      {engine['hf_tokens_per_s']:.1f} tokens/s",
        f"speedup (goal >= 3x)                    {figures['engine_over_hf_speedup']:.2f}x",
        f"prefix-cache hit ratio                  {figures['prefix_cache_hit_ratio']:.3f}",
        f"greedy outputs identical to HF          {engine['greedy_outputs_identical']}",
        *[
            f"migration vs recompute at {key:<4}          {m['migrate_ms']:.1f} ms vs {m['recompute_ms']:.1f} ms "
            f"= {m['recompute_over_migrate']:.1f}x"
            for key, m in figures["migration"].items()
        ],
        f"gateway overhead p50 / p99 (goal < 5)   {figures['gateway_overhead_ms_p50']:.2f} / "
        f"{figures['gateway_overhead_ms_p99']:.2f} ms ({gateway['calls_measured']} calls)",
        f"gateway internal p50 / p99              {figures['gateway_internal_ms_p50']:.2f} / "
        f"{figures['gateway_internal_ms_p99']:.2f} ms",
        f"wall time                               {figures['wall_s']:.1f} s",
    ]
    print("\n".join(lines))
    write_figures(figures, out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=DEFAULT_OUT)
    cli = parser.parse_args()
    sys.exit(main(quick=cli.quick, out=cli.out))
