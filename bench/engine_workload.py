"""The rollout engine's workloads, measured by bench/engine.py (`gyre bench engine`) and bench/gpu.

    agent_turns(engine, rng, sessions, turns, ...)  the multi-turn agent workload on our engine
    bench_engine(model, n_sessions=8, turns=6)      that workload: our engine vs HF generate() called
                                                    per turn on the full context
    bench_migration(model, context_tokens=2048)     KV migration (export + shm transport + import) vs
                                                    recomputing the same context (a prefill)
    cache_figures(stats)                            prefill and prefix-cache counters of a run
    device_clock(device)                            perf_counter once the device finished its queue

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

from engines.admin import EngineCounters
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


Turn = tuple[list[list[int]], list[list[int]]]  # one turn of every session: (prompts, our outputs)


def agent_turns(
    engine: RolloutEngine,
    rng: random.Random,
    sessions: int,
    turns: int,
    max_tokens: int,
    first_prompt_tokens: tuple[int, int],
    tool_tokens: tuple[int, int],
) -> tuple[list[Turn], float]:
    """Every session starts from a random prompt; each turn's prompt is the previous prompt + our
    output + a random tool result, all sessions' turns batched on ``engine``, greedy. Returns every
    turn's prompts and outputs and the device-synchronized seconds it took."""
    vocab = engine.runner.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    prompts = [
        [rng.randrange(vocab) for _ in range(rng.randint(*first_prompt_tokens))] for _ in range(sessions)
    ]
    seen: list[Turn] = []
    started = device_clock(engine.runner.device)
    for turn in range(turns):
        requests = [
            GenerateRequest(
                request_id=f"s{s}-t{turn}", session_id=f"s{s}", prompt_ids=prompts[s], sampling=greedy
            )
            for s in range(sessions)
        ]
        outputs = [out.output_ids for out in engine.generate(requests)]
        seen.append((prompts, outputs))
        prompts = [
            p + o + [rng.randrange(vocab) for _ in range(rng.randint(*tool_tokens))]
            for p, o in zip(prompts, outputs, strict=True)
        ]
    return seen, device_clock(engine.runner.device) - started


def cache_figures(stats: EngineCounters) -> dict[str, float]:
    """Our engine's prefill and prefix-cache counters after a workload."""
    return {
        "ours_prefilled_tokens": stats.prefilled_tokens,
        "ours_cached_tokens": stats.cached_tokens,
        "prefix_cache_hit_ratio": round(
            stats.cached_tokens / max(1, stats.cached_tokens + stats.prefilled_tokens), 4
        ),
        "ours_max_running": stats.max_running,
    }


def _bench_engine(
    model, n_sessions, turns, max_tokens, first_prompt_tokens, tool_tokens, seed, config
) -> dict:
    longest = first_prompt_tokens[1] + turns * (max_tokens + tool_tokens[1]) + 1
    config = config or EngineConfig(max_batch_size=n_sessions, max_model_len=longest)
    engine = RolloutEngine(model, config)
    seen, ours_s = agent_turns(
        engine, random.Random(seed), n_sessions, turns, max_tokens, first_prompt_tokens, tool_tokens
    )
    calls = [call for prompts, outputs in seen for call in zip(prompts, outputs, strict=True)]
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
    return {
        "n_sessions": n_sessions,
        "turns": turns,
        "calls": len(calls),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "ours_seconds": round(ours_s, 4),
        "ours_tokens_per_s": round(generated / ours_s, 1),
        **cache_figures(engine.stats),
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
        moved = device_clock(target.runner.device) - start
        fresh = RolloutEngine(model, config)
        start = time.perf_counter()
        fresh.generate(
            [GenerateRequest(request_id=f"p{r}", session_id=f"p{r}", prompt_ids=context, sampling=one)]
        )
        prefill = device_clock(fresh.runner.device) - start
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


def device_clock(device: torch.device) -> float:
    """perf_counter after the device finished everything queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextlib.contextmanager
def _threads(n: int | None):
    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
