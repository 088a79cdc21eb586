"""Benchmark helpers for the rollout engine (plain functions; no CLI here, bench/ wires them).

    bench_engine(model, n_sessions=8, turns=6)   multi-turn agent-shaped workload: our engine vs HF
                                                 generate() called per turn on the full context
    bench_migration(model, context_tokens=2048)  KV migration (export + shm transport + import) vs
                                                 recomputing the same context (a prefill)

Workload of bench_engine: every session starts from a random prompt; each turn's prompt is the previous
prompt + the previous output + a random "tool result" of 50-300 tokens, so contexts grow as in an
agent loop. All sessions' turns run as one batch on our engine (prefix cache + continuous batching);
the same prompts, recorded from our run, then go through HF generate one call at a time with the same
number of new tokens (greedy both sides, so the outputs can be compared token for token; our engine
stops only at stop_token_ids, none here, and HF is held to the same count with min_new_tokens).
Figures are wall-clock on whatever device the model sits on; nothing asserts on them. ``cpu_threads``
sets torch's intra-op threads for the run and restores them (a 32-wide test model is fastest on one).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time

import torch

from engines.rollout.config import EngineConfig
from engines.rollout.engine import RolloutEngine
from engines.rollout.messages import GenerateRequest, SamplingParams
from engines.rollout.migration import ShmTransport


def bench_engine(
    model: torch.nn.Module,
    n_sessions: int = 8,
    turns: int = 6,
    *,
    max_tokens: int = 32,
    first_prompt_tokens: tuple[int, int] = (64, 256),
    tool_tokens: tuple[int, int] = (50, 300),
    seed: int = 0,
    config: EngineConfig | None = None,
    cpu_threads: int | None = None,
) -> dict:
    """Tokens/s and prefix-cache hit ratio, our engine vs HF generate per turn on the full context."""
    with _threads(cpu_threads):
        return _bench_engine(
            model, n_sessions, turns, max_tokens, first_prompt_tokens, tool_tokens, seed, config
        )


def _bench_engine(
    model, n_sessions, turns, max_tokens, first_prompt_tokens, tool_tokens, seed, config
) -> dict:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    longest = first_prompt_tokens[1] + turns * (max_tokens + tool_tokens[1]) + 1
    config = config or EngineConfig(max_batch_size=n_sessions, max_model_len=longest)
    engine = RolloutEngine(model, config)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    prompts = {
        s: [rng.randrange(vocab) for _ in range(rng.randint(*first_prompt_tokens))] for s in range(n_sessions)
    }
    calls: list[tuple[list[int], list[int]]] = []  # (prompt, our output) per call, for the HF replay
    start = time.perf_counter()
    for turn in range(turns):
        requests = [
            GenerateRequest(
                request_id=f"s{s}-t{turn}", session_id=f"s{s}", prompt_ids=prompts[s], sampling=greedy
            )
            for s in range(n_sessions)
        ]
        for s, out in enumerate(engine.generate(requests)):
            calls.append((prompts[s], out.output_ids))
            tool = [rng.randrange(vocab) for _ in range(rng.randint(*tool_tokens))]
            prompts[s] = prompts[s] + out.output_ids + tool
    ours_s = time.perf_counter() - start
    generated = sum(len(out) for _, out in calls)
    prompt_tokens = sum(len(p) for p, _ in calls)

    start = time.perf_counter()
    agree = 0
    with torch.inference_mode():
        for prompt, ours in calls:
            ids = torch.tensor([prompt], device=engine.runner.device)
            hf = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=len(ours),
                min_new_tokens=len(ours),
                do_sample=False,
                pad_token_id=0,
            )
            agree += hf[0, len(prompt) :].tolist() == ours
    hf_s = time.perf_counter() - start
    stats = engine.stats
    return {
        "n_sessions": n_sessions,
        "turns": turns,
        "calls": len(calls),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "ours_seconds": round(ours_s, 4),
        "ours_tokens_per_s": round(generated / ours_s, 1),
        "ours_prefilled_tokens": stats.prefilled_tokens,
        "ours_cached_tokens": stats.cached_tokens,
        "prefix_cache_hit_ratio": round(
            stats.cached_tokens / max(1, stats.cached_tokens + stats.prefilled_tokens), 4
        ),
        "ours_max_running": stats.max_running,
        "hf_seconds": round(hf_s, 4),
        "hf_tokens_per_s": round(generated / hf_s, 1),
        "hf_prefilled_tokens": prompt_tokens,
        "speedup": round(hf_s / ours_s, 2),
        "greedy_outputs_identical": f"{agree}/{len(calls)}",
        "device": str(engine.runner.device),
        "torch_threads": torch.get_num_threads(),
    }


def bench_migration(
    model: torch.nn.Module,
    context_tokens: int = 2048,
    *,
    repeats: int = 3,
    seed: int = 0,
    cpu_threads: int | None = None,
) -> dict:
    """Moving a session's KV (export + ShmTransport send/receive + import) vs prefilling the same context
    on a fresh engine. Medians over ``repeats``."""
    with _threads(cpu_threads):
        return _bench_migration(model, context_tokens, repeats, seed)


def _bench_migration(model, context_tokens, repeats, seed) -> dict:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    config = EngineConfig(max_model_len=context_tokens + 8, kv_budget_tokens=4 * (context_tokens + 8))
    source, target = RolloutEngine(model, config), RolloutEngine(model, config)
    transport = ShmTransport()
    one = SamplingParams(temperature=0, max_tokens=1)
    migrate, recompute, kv_bytes = [], [], 0
    for r in range(repeats + 1):  # the first round warms up and is dropped
        context = [rng.randrange(vocab) for _ in range(context_tokens)]
        source.generate(
            [GenerateRequest(request_id=f"m{r}", session_id=f"m{r}", prompt_ids=context, sampling=one)]
        )
        start = time.perf_counter()
        state = source.export_session(f"m{r}")
        kv_bytes = state.kv_bytes
        target.import_session(transport.receive(transport.send(state)))
        _sync(target)
        moved = time.perf_counter() - start
        fresh = RolloutEngine(model, config)
        start = time.perf_counter()
        fresh.generate(
            [GenerateRequest(request_id=f"p{r}", session_id=f"p{r}", prompt_ids=context, sampling=one)]
        )
        _sync(fresh)
        prefill = time.perf_counter() - start
        if r:
            migrate.append(moved)
            recompute.append(prefill)
    migrate_ms, recompute_ms = statistics.median(migrate) * 1e3, statistics.median(recompute) * 1e3
    return {
        "context_tokens": context_tokens,
        "kv_bytes": kv_bytes,
        "migrate_ms": round(migrate_ms, 3),
        "recompute_ms": round(recompute_ms, 3),
        "recompute_over_migrate": round(recompute_ms / migrate_ms, 2),
        "target_prefilled_tokens": target.stats.prefilled_tokens,
        "device": str(target.runner.device),
        "torch_threads": torch.get_num_threads(),
    }


def _sync(engine: RolloutEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


@contextlib.contextmanager
def _threads(n: int | None):
    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
