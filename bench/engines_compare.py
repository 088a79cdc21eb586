"""`gyre bench engine --engines gyre,vllm`: the rollout engines side by side, each as a campaign runs it
(a server process behind our engine API, started by stack/serving.py), on the same workload.

    gyre bench engine --engines gyre,vllm [--quick] [--out bench/results/engines.json]

Model: the shipped policy data/policies/tiny-sft (Qwen2, 4 layers), float32, one thread per engine
(OMP_NUM_THREADS=1; vLLM's CPU build unbound, so the two engines get the same budget). Each engine runs
alone, one after the other, on a quiet host; read the ratios, not the seconds.

1. Multi-turn agent workload at concurrency 8: 8 sessions in parallel, each an agent loop of ``turns``
   calls whose prompt is the previous prompt + the previous output + a 50-300-token tool result
   (seeded ids), ``max_tokens`` new tokens sampled at temperature 1 with a seed per request.
   ``tokens_per_s`` = output tokens / wall seconds; ``prefix_cache_hit_ratio`` = cached prompt tokens /
   prompt tokens (the engine's own counters, /admin/stats).
2. Time to first token: the same workload shape with max_tokens = 1 (fresh sessions, another seed), so
   a call's latency is its queueing + prefill of what the cache does not hold + one token;
   ``ttft_ms_p50 / p99`` over those calls.
3. Moving a session of 2K and 8K tokens of context to another engine of the same kind: our engine
   exports its KV and the target imports it (``migrate_ms``); the target prefills the recorded context
   (``recompute_ms``: a prompt the target has not seen, max_tokens 1), vLLM's way without a connector
   and our engine's fallback. For vLLM, ``vllm_kv_connector``: the same move through its reference KV
   connector (ExampleConnector, a folder in /dev/shm both engines share), see connector_moves.

``vllm_over_gyre`` holds the ratios (throughput, TTFT p50, hit ratio).
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx

from bench.figures import write_figures
from engines.admin import EXPORT_SESSION, IMPORT_SESSION, AdminClient, SessionExport, SessionImport
from engines.net import free_port
from engines.quantiles import quantile
from stack.serving import ServingConfig, engine_process
from stack.stack import serving_process

DEFAULT_OUT = "bench/results/engines.json"
POLICY = "data/policies/tiny-sft"
CONCURRENCY = 8
PRESETS = {
    "quick": {"turns": 4, "max_tokens": 32, "contexts": [2048, 8192], "repeats": 2},
    "full": {"turns": 8, "max_tokens": 64, "contexts": [2048, 8192], "repeats": 3},
}
TOKEN = "bench-engine-admin"
VOCAB = (10, 4000)  # ordinary ids of the policy's vocabulary (no control tokens)


@contextlib.contextmanager
def engine_server(
    kind: str,
    policy: str = POLICY,
    vllm_args: list[str] | None = None,
    *,
    dtype: Literal["float32", "bfloat16"] = "float32",
    vllm_python: str | None = None,
) -> Iterator[str]:
    """One engine of ``kind`` serving ``policy``, as a campaign starts it; yields its URL (its process
    tree's pid in PIDS). ``vllm_python``: vLLM's environment (None: ServingConfig's default)."""
    port = free_port()
    serving = ServingConfig(
        engine=kind,
        engine_dtype=dtype,
        max_batch_size=CONCURRENCY,
        vllm_python=vllm_python,
        vllm_args=vllm_args or [],
    )
    command, stdin, _ = engine_process(policy, serving, port, TOKEN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}"
    with serving_process(command, url, env, stdin=stdin) as process:
        PIDS[url] = process.pid
        yield url


PIDS: dict[str, int] = {}


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (vLLM's engine core and workers), MiB."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return round(total / 1024, 1)


def role_switch(url: str) -> dict[str, Any]:
    """A cell's switch to training and back: sleep, then wake serving a version (the policy again),
    each timed, with the engine's memory awake and asleep."""
    with AdminClient(engine_token=TOKEN) as admin:
        awake = tree_rss_mib(PIDS[url])
        start = time.perf_counter()
        admin.sleep(url)
        sleep_ms = (time.perf_counter() - start) * 1000
        time.sleep(1.0)
        asleep = tree_rss_mib(PIDS[url])
        start = time.perf_counter()
        admin.wake(url, os.path.abspath(POLICY), 1)
        wake_ms = (time.perf_counter() - start) * 1000
    return {
        "sleep_ms": round(sleep_ms, 1),
        "wake_ms": round(wake_ms, 1),
        "rss_awake_mib": awake,
        "rss_asleep_mib": asleep,
    }


def _complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int, seed: int, session: str):
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "session_id": session,
    }
    response = client.post(f"{url}/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


def agent_workload(url: str, turns: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """CONCURRENCY sessions in parallel, each ``turns`` calls whose context grows; per-call latencies."""
    latencies: list[float] = []
    outputs = [0]
    lock = threading.Lock()

    def session(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        prompt = [rng.randrange(*VOCAB) for _ in range(rng.randrange(200, 400))]
        with httpx.Client() as client:
            for turn in range(turns):
                start = time.perf_counter()
                output = _complete(
                    client, url, prompt, max_tokens, seed * 100 + index * 10 + turn, f"s{seed}-{index}"
                )
                took = time.perf_counter() - start
                with lock:
                    latencies.append(took)
                    outputs[0] += len(output)
                prompt = prompt + output + [rng.randrange(*VOCAB) for _ in range(rng.randrange(50, 300))]

    start = time.perf_counter()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(CONCURRENCY)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {
        "wall_s": round(wall, 2),
        "calls": len(latencies),
        "output_tokens": outputs[0],
        "latencies": latencies,
    }


def _one_token_ms(client: httpx.Client, url: str, prompt: list[int], seed: int, session: str) -> float:
    """Milliseconds of a one-token call on ``prompt``: its prefill, nearly all of it."""
    start = time.perf_counter()
    _complete(client, url, prompt, 1, seed, session)
    return (time.perf_counter() - start) * 1000


def moving_a_session(url: str, target: str, kind: str, context: int, repeats: int) -> dict[str, Any]:
    """Milliseconds to serve a session's next call on ``target``: by KV migration (ours) and by
    prefilling its recorded context there (both engines)."""
    recompute, migrate = [], []
    with httpx.Client() as client, AdminClient(engine_token=TOKEN) as admin:
        for repeat in range(repeats):
            rng = random.Random(context * 10 + repeat)
            prompt = [rng.randrange(*VOCAB) for _ in range(context)]
            recompute.append(_one_token_ms(client, target, prompt, repeat, f"fresh-{context}-{repeat}"))
            if kind == "gyre":
                session = f"move-{context}-{repeat}"
                _complete(client, url, prompt[::-1], 1, repeat, session)  # held by the source
                start = time.perf_counter()
                handle = admin.call(EXPORT_SESSION, url, TOKEN, SessionExport(session_id=session))
                admin.call(IMPORT_SESSION, target, TOKEN, SessionImport(handle=handle, wait=False))
                migrate.append((time.perf_counter() - start) * 1000)
    figures: dict[str, Any] = {"recompute_ms": round(statistics.median(recompute), 1)}
    if migrate:
        figures["migrate_ms"] = round(statistics.median(migrate), 1)
        figures["recompute_over_migrate"] = round(figures["recompute_ms"] / figures["migrate_ms"], 1)
    else:
        figures["migrate_ms"] = None
        figures["way"] = "prefill of the recorded context on the target (no KV connector configured)"
    return figures


# --disable-log-stats: with ExampleConnector, vLLM 0.32's metrics logger raises on a negative counter
# increment at 8K tokens ("Counters can only be incremented by non-negative amounts") and the engine
# core dies; without the stats logger the connector serves 2K and 8K (measured 2026-12-05)
CONNECTOR_ARGS = ["--disable-log-stats", "--kv-transfer-config"]


def connector_moves(contexts: list[int], repeats: int) -> dict[str, Any]:
    """vLLM's ExampleConnector (its reference KV connector; it runs on the CPU build): two engines share
    a folder in /dev/shm; the source saves every prefill's KV there, the target loads what matches a
    new prompt instead of prefilling it. Per context: the source's call that saves (``save_ms``), the
    target's call that loads (``load_ms``), and the same prompt prefilled on a third, plain path
    (``recompute_ms``: the target with a prompt nobody saved)."""
    figures: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(dir="/dev/shm", prefix="gyre-kv-") as shared,
        contextlib.ExitStack() as stack,
    ):
        config = (
            '{"kv_connector":"ExampleConnector","kv_role":"kv_both",'
            f'"kv_connector_extra_config":{{"shared_storage_path":"{shared}"}}}}'
        )
        source = stack.enter_context(engine_server("vllm", vllm_args=[*CONNECTOR_ARGS, config]))
        target = stack.enter_context(engine_server("vllm", vllm_args=[*CONNECTOR_ARGS, config]))
        with httpx.Client() as client:
            for context in contexts:
                save, load, recompute = [], [], []
                for repeat in range(repeats):
                    rng = random.Random(context * 7 + repeat)
                    prompt = [rng.randrange(*VOCAB) for _ in range(context)]
                    save.append(_one_token_ms(client, source, prompt, repeat, f"save-{context}-{repeat}"))
                    load.append(
                        _one_token_ms(client, target, [*prompt, 11], repeat, f"load-{context}-{repeat}")
                    )
                    fresh = [rng.randrange(*VOCAB) for _ in range(context)]
                    recompute.append(
                        _one_token_ms(client, target, fresh, repeat, f"fresh-{context}-{repeat}")
                    )
                figures[f"{context // 1024}k"] = {
                    "save_ms": round(statistics.median(save), 1),
                    "load_ms": round(statistics.median(load), 1),
                    "recompute_ms": round(statistics.median(recompute), 1),
                    "recompute_over_load": round(statistics.median(recompute) / statistics.median(load), 2),
                }
    return figures


def bench_one(kind: str, preset: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(engine_server(kind))
        target = stack.enter_context(engine_server(kind))
        start_s = round(time.perf_counter() - started, 1)
        with AdminClient(engine_token=TOKEN) as admin:
            before = admin.engine_stats(url)
            load = agent_workload(url, preset["turns"], preset["max_tokens"], seed=1)
            after = admin.engine_stats(url)
        ttft = agent_workload(url, preset["turns"], 1, seed=2)
        prompt = (after.prefilled_tokens - before.prefilled_tokens) + (
            after.cached_tokens - before.cached_tokens
        )
        moves = {
            f"{c // 1024}k": moving_a_session(url, target, kind, c, preset["repeats"])
            for c in preset["contexts"]
        }
        switch = role_switch(url)
    latencies = load.pop("latencies")
    return {
        **load,
        "start_s": start_s,
        "tokens_per_s": round(load["output_tokens"] / load["wall_s"], 1),
        "call_ms_p50": round(quantile(latencies, 0.5) * 1000, 1),
        "prompt_tokens": prompt,
        "prefix_cache_hit_ratio": round((after.cached_tokens - before.cached_tokens) / max(1, prompt), 3),
        "ttft_ms_p50": round(quantile(ttft["latencies"], 0.5) * 1000, 1),
        "ttft_ms_p99": round(quantile(ttft["latencies"], 0.99) * 1000, 1),
        "moving_a_session": moves,
        "role_switch": switch,
    }


def run(engines: list[str], quick: bool) -> dict[str, Any]:
    preset = PRESETS["quick" if quick else "full"]
    figures: dict[str, Any] = {
        "preset": "quick" if quick else "full",
        "policy": POLICY,
        "concurrency": CONCURRENCY,
        "threads_per_engine": 1,
        **{k: preset[k] for k in ("turns", "max_tokens")},
        "host_cpus": os.cpu_count(),
        "engines": {},
    }
    for kind in engines:
        print(
            f"{kind}: two engines, {CONCURRENCY} sessions x {preset['turns']} turns, then moves", flush=True
        )
        figures["engines"][kind] = bench_one(kind, preset)
    if "vllm" in engines:
        print("vllm: two engines sharing a KV connector (ExampleConnector in /dev/shm)", flush=True)
        try:
            figures["vllm_kv_connector"] = connector_moves(preset["contexts"], preset["repeats"])
        except (httpx.HTTPError, RuntimeError) as exc:  # a way that fails is a finding: say so, keep the rest
            figures["vllm_kv_connector_error"] = repr(exc)[:500]
            print(f"vllm: the KV connector failed: {exc!r}", flush=True)
    if {"gyre", "vllm"} <= set(engines):
        ours, theirs = figures["engines"]["gyre"], figures["engines"]["vllm"]
        figures["vllm_over_gyre"] = {
            "tokens_per_s": round(theirs["tokens_per_s"] / ours["tokens_per_s"], 2),
            "ttft_ms_p50": round(theirs["ttft_ms_p50"] / ours["ttft_ms_p50"], 2),
            "prefix_cache_hit_ratio": round(
                theirs["prefix_cache_hit_ratio"] / max(1e-9, ours["prefix_cache_hit_ratio"]), 2
            ),
        }
    return figures


def main(engines: str = "gyre,vllm", quick: bool = False, out: str = DEFAULT_OUT) -> int:
    kinds = [kind.strip() for kind in engines.split(",") if kind.strip()]
    unknown = set(kinds) - {"gyre", "vllm"}
    if unknown:
        raise ValueError(f"--engines: unknown engine(s) {sorted(unknown)}; choose from gyre, vllm")
    figures = run(kinds, quick)
    for kind, f in figures["engines"].items():
        print(
            f"{kind:<5} {f['tokens_per_s']:>7.1f} tokens/s at concurrency {CONCURRENCY}, TTFT p50/p99 "
            f"{f['ttft_ms_p50']:.0f}/{f['ttft_ms_p99']:.0f} ms, prefix-cache hits {f['prefix_cache_hit_ratio']:.3f}, "
            f"started in {f['start_s']} s"
        )
        switch = f["role_switch"]
        print(
            f"      sleep {switch['sleep_ms']} ms, wake with a version {switch['wake_ms']} ms; memory awake "
            f"{switch['rss_awake_mib']} MiB, asleep {switch['rss_asleep_mib']} MiB"
        )
        for key, move in f["moving_a_session"].items():
            migrated = f", KV migration {move['migrate_ms']} ms" if move.get("migrate_ms") else ""
            print(f"      moving a {key} session: prefill on the target {move['recompute_ms']} ms{migrated}")
    for key, move in figures.get("vllm_kv_connector", {}).items():
        print(
            f"vllm  moving a {key} session through the KV connector: saved in {move['save_ms']} ms on the source, "
            f"loaded in {move['load_ms']} ms on the target (prefill there: {move['recompute_ms']} ms)"
        )
    if "vllm_over_gyre" in figures:
        ratio = figures["vllm_over_gyre"]
        print(
            f"vllm / gyre: throughput {ratio['tokens_per_s']}x, TTFT p50 {ratio['ttft_ms_p50']}x, "
            f"prefix-cache hit ratio {ratio['prefix_cache_hit_ratio']}x"
        )
    write_figures(figures, out)
    return 0
