"""The engine section: a multi-turn agent workload at batch 1/16/64, our engine against HF
``generate`` on the very same prompts (one batched call per turn, left padding, the full context
every turn), greedy on both sides so the outputs can be compared token for token."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from bench.engine_workload import agent_turns, cache_figures, device_clock
from bench.gpu.run import Run, attempt
from engines.rollout.config import EngineConfig
from engines.rollout.engine import RolloutEngine


def section_engine(run: Run, figures: dict, deadline: float) -> None:
    plan, device = run.plan, run.device
    figures["hf_mode"] = (
        "HF generate: one batched call per turn at the same batch size, left padding, the full context "
        "every turn (no prefix cache), greedy, exactly max_tokens new tokens (min_new_tokens)"
    )
    figures["runs"] = []
    models = {}
    for preset in plan.engine_presets:
        models[preset] = run.load(preset)
        _engine_workload(models[preset], 2, 1, 4, (16, 32), (8, 16), device, seed=99)  # warm-up
    for batch in plan.batch_sizes:
        for preset, model in models.items():
            if time.monotonic() > deadline:
                figures.setdefault("skipped", []).append(
                    f"{preset} batch {batch}: the section's time ran out"
                )
                continue
            result = attempt(
                figures,
                f"{preset} batch {batch}",
                lambda model=model, batch=batch: _engine_workload(
                    model,
                    batch,
                    plan.turns,
                    plan.max_tokens,
                    plan.first_prompt_tokens,
                    plan.tool_tokens,
                    device,
                ),
            )
            if result is not None:
                for label, error in result.pop("errors", {}).items():
                    figures.setdefault("errors", {})[f"{preset} batch {batch} {label}"] = error
                figures["runs"].append({"preset": preset, **result})
            run.write()


def _engine_workload(
    model: torch.nn.Module,
    batch: int,
    turns: int,
    max_tokens: int,
    first_prompt_tokens: tuple[int, int],
    tool_tokens: tuple[int, int],
    device: torch.device,
    seed: int = 0,
) -> dict[str, Any]:
    longest = first_prompt_tokens[1] + turns * (max_tokens + tool_tokens[1]) + 8
    config = EngineConfig(
        max_batch_size=batch, max_model_len=longest, kv_budget_tokens=batch * longest, device=str(device)
    )
    engine = RolloutEngine(model, config)
    turns_seen, ours_s = agent_turns(
        engine, random.Random(seed + batch), batch, turns, max_tokens, first_prompt_tokens, tool_tokens
    )
    stats = engine.stats
    del engine
    generated = sum(len(o) for _, outputs in turns_seen for o in outputs)
    figures = {
        "batch": batch,
        "turns": turns,
        "calls": batch * turns,
        "prompt_tokens": sum(len(p) for prompts_, _ in turns_seen for p in prompts_),
        "generated_tokens": generated,
        "ours_s": round(ours_s, 3),
        "ours_tokens_per_s": round(generated / ours_s, 1),
        **cache_figures(stats),
    }
    hf = attempt(figures, "hf_generate", lambda: _hf_generate(model, turns_seen, batch, max_tokens, device))
    if hf is not None:
        hf_s, agree, hf_prefilled = hf
        figures.update(
            hf_s=round(hf_s, 3),
            hf_tokens_per_s=round(generated / hf_s, 1),
            hf_prefilled_tokens_with_padding=hf_prefilled,
            speedup_vs_hf=round(hf_s / ours_s, 2),
            greedy_outputs_identical=f"{agree}/{batch * turns}",
        )
    return figures


def _hf_generate(model, turns_seen, batch: int, max_tokens: int, device) -> tuple[float, int, int]:
    """HF generate on the prompts our engine saw: (seconds, outputs identical to ours, prefilled tokens)."""
    pad = model.generation_config.pad_token_id or 0
    agree, hf_prefilled = 0, 0
    started = device_clock(device)
    with torch.inference_mode():
        for turn_prompts, ours in turns_seen:
            width = max(len(p) for p in turn_prompts)
            ids = torch.full((batch, width), pad, dtype=torch.long)
            mask = torch.zeros((batch, width), dtype=torch.long)
            for row, prompt in enumerate(turn_prompts):  # left padding
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
            agree += sum(row == mine for row, mine in zip(out[:, width:].tolist(), ours, strict=True))
            hf_prefilled += batch * width
    return device_clock(device) - started, agree, hf_prefilled
