"""The rollout engine's benchmark workloads (bench/engine_workload.py) at toy size: the counts they
report are checked, never the timings."""

from __future__ import annotations

import itertools
import random

import pytest

from bench.engine_workload import agent_turns, bench_engine, bench_migration
from engines.rollout import EngineConfig, RolloutEngine
from tests.test_rollout_fixtures import tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_policy()


def test_bench_helpers_smoke(model):
    """Runs the benchmark helpers at toy size; figures are printed by bench/, never asserted."""
    figures = bench_engine(
        model, n_sessions=2, turns=2, max_tokens=4, first_prompt_tokens=(8, 12), tool_tokens=(5, 9)
    )
    assert figures["calls"] == 4 and figures["greedy_outputs_identical"] == "4/4"
    assert 0 < figures["prefix_cache_hit_ratio"] < 1 and figures["ours_max_running"] == 2
    moved = bench_migration(model, context_tokens=64, repeats=1)
    assert moved["target_prefilled_tokens"] == 0 and moved["kv_bytes"] == 64 * 2 * 2 * 2 * 8 * 4


def test_agent_turns_grow_each_prompt_by_the_output_and_a_tool_result(model):
    engine = RolloutEngine(model, EngineConfig(max_batch_size=3, max_model_len=128))
    seen, seconds = agent_turns(engine, random.Random(1), 3, 3, 4, (8, 12), (5, 9))
    assert len(seen) == 3 and seconds > 0
    for (prompts, outputs), (after, _) in itertools.pairwise(seen):
        for prompt, output, grown in zip(prompts, outputs, after, strict=True):
            assert len(output) == 4
            assert grown[: len(prompt) + 4] == prompt + output and 5 <= len(grown) - len(prompt) - 4 <= 9
    assert engine.stats.cached_tokens > 0  # later turns reuse each session's prefix
