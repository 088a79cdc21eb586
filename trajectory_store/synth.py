"""Synthetic, paper-shaped traces of xLong-horizon coding-agent executions.

Tests, the sample trace (``data/sample_trace.jsonl``) and the storage benchmark need executions
that look like real agent runs without running a model. ``generate`` yields, per execution, one
execution record and then its call records in call order, in the JSONL interchange shape of
DESIGN.md section 4 (full prompt ids on every call). The token ids are random; the *shape* is what
matters, because it makes every execution a prefix-shared tree:

- the main agent is multi-turn: each prompt is the previous prompt + its output + a tool result;
- context compression: when the next prompt would pass ``max_context``, a summary call
  (``main_summary``/``sub_summary``) summarizes the context, and the agent restarts from
  system + instruction + a header + the summary;
- sub-agents: a main output can delegate a slice of itself to ``sub-N``, which runs its own
  multi-turn context (with its own compression) between two main calls; its final output is fed
  back to the main agent as the tool result;
- retries: a call can be retried with the same prompt; the retry regenerates the failed output's
  opening and then diverges, or differs entirely; the failed branch is a dead end;
- policy versions advance mid-execution (async rollouts), and timed-out executions end with a
  call cut at ``finish_reason="length"``.

Every number comes from one ``np.random.Generator`` seeded by ``SynthConfig.seed``: the same config
always yields the same records. Only numpy and the standard library are used.

Run it::

    python -m trajectory_store.synth --preset sample --out data/sample_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

BASE_EPOCH = 1_790_000_000.0  # unix seconds of the first execution's start
SUMMARIZE_INSTRUCTION_TOKENS = 30  # "summarize the work so far" appended to a context
SUMMARY_HEADER_TOKENS = 6  # "here is a summary of earlier work" before a re-fed summary
SUB_RESULT_HEADER_TOKENS = 4  # wraps a sub-agent's final output in the main agent's tool result
LONG_OUTPUT_PROBABILITY = 0.05  # an output is a file write, up to LONG_OUTPUT_FACTOR x longer
LONG_OUTPUT_FACTOR = 4
POLICY_UPDATE_PROBABILITY = 0.02  # per call: new weights arrived before this call
N_ENGINES = 4


@dataclass(frozen=True)
class SynthConfig:
    """Sizes and probabilities of a synthetic trace. Lengths are in tokens."""

    n_problems: int = 2  # groups
    group_size: int = 4  # executions per problem (same problem_id / group_id)
    vocab_size: int = 32000  # token ids are drawn from [0, vocab_size)
    system_tokens: int = 300  # length of the main agent's system prompt (shared by the whole trace)
    instruction_tokens: int = 400  # length of a problem's instruction (shared by its group)
    max_turns: int = 40  # most main-agent turns per execution (heavy tailed; summaries etc. extra)
    max_context: int = 16384  # a context that would grow past this is compressed by a summary call
    tool_result_tokens: tuple[int, int] = (50, 2500)  # clipped lognormal range of a tool result
    output_tokens: tuple[int, int] = (20, 400)  # typical output range; 5% are up to 4x longer
    summary_tokens: tuple[int, int] = (200, 1200)  # uniform range of a summary's length
    p_subagent: float = 0.08  # per main turn: the output delegates a subtask to a sub-agent
    p_retry: float = 0.06  # per call: the call fails and is retried with the same prompt
    p_timeout: float = 0.15  # per execution: it ends with status "timeout" (reward from a snapshot)
    seed: int = 0  # seeds the single generator behind every number
    # Guarantee every shape exists: the first execution delegates on main turn 1, retries main
    # turn 2, and its main agent and first sub-agent compress by mid-run if they have not yet;
    # the last execution times out.
    force_shapes: bool = False

    @property
    def max_output_tokens(self) -> int:
        """Longest possible model output (a file write)."""
        return max(self.output_tokens[1] * LONG_OUTPUT_FACTOR, self.summary_tokens[1])


PRESETS: dict[str, SynthConfig] = {
    # 2 problems x 2 executions of 10-20 calls (seed picked for that), contexts up to ~1500 tokens,
    # every shape present; its JSONL stays small.
    "sample": SynthConfig(
        n_problems=2,
        group_size=2,
        vocab_size=1000,
        system_tokens=60,
        instruction_tokens=60,
        max_turns=20,
        max_context=1500,
        tool_result_tokens=(20, 300),
        output_tokens=(10, 60),
        summary_tokens=(40, 150),
        p_subagent=0.1,
        p_retry=0.06,
        p_timeout=0.1,
        force_shapes=True,
        seed=30,
    ),
    # A few executions with 16K contexts; generates in well under 5 s.
    "quick": SynthConfig(n_problems=2, group_size=2, max_turns=100, force_shapes=True),
    # 8 executions, contexts up to 128K, hundreds of calls per execution.
    "full": SynthConfig(
        n_problems=2, group_size=4, max_turns=500, max_context=131072, p_subagent=0.02, force_shapes=True
    ),
}


def preset(name: str) -> SynthConfig:
    """The named preset config; raises ValueError naming the valid presets."""
    if name not in PRESETS:
        raise ValueError(f"unknown synth preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True)
class _HarnessTokens:
    """Token blocks fixed by the (synthetic) harness, identical in every execution of the trace."""

    system: np.ndarray  # main agent's system prompt
    sub_system: np.ndarray  # every sub-agent's system prompt
    summarize_instruction: np.ndarray  # appended to a context to ask for a summary
    summary_header: np.ndarray  # precedes a re-fed summary in a compressed context
    sub_result_header: np.ndarray  # precedes a sub-agent's result in the main agent's tool result


def _lognormal_int(rng: np.random.Generator, lo: int, hi: int, median: float, sigma: float) -> int:
    """A heavy-tailed integer: lognormal around ``median``, clipped to [lo, hi]."""
    return int(np.clip(round(rng.lognormal(np.log(max(median, 1.0)), sigma)), lo, hi))


class _ExecutionBuilder:
    """Simulates the executions of a trace one at a time; ``simulate`` returns one's records."""

    execution_id: str
    forced: bool  # force a delegation, a retry and compressions in this execution
    pending_forced_compressions: set[str]  # agents that must still compress once by mid-run
    clock: float  # simulated unix time of the next event
    policy_version: int  # advances when new weights reach the engine (async rollouts)
    engine_index: int  # the engine serving the execution; it can change with a weight update
    n_subagents: int  # sub-agents started so far (numbers their agent ids)
    calls: list[dict[str, Any]]  # call records of the current execution, in call order

    def __init__(self, cfg: SynthConfig, rng: np.random.Generator, harness: _HarnessTokens) -> None:
        self.cfg = cfg
        self.rng = rng
        self.harness = harness
        # Regular prompts stay within this, so a summary prompt stays within max_context + max output.
        self.context_budget = cfg.max_context - len(harness.summarize_instruction)

    def simulate(self, problem: int, k: int, instruction: np.ndarray) -> list[dict[str, Any]]:
        """Simulates execution ``k`` of ``problem``: its execution record, then its call records."""
        cfg, rng = self.cfg, self.rng
        index = problem * cfg.group_size + k
        self.execution_id, self.forced = f"p{problem}-e{k}", cfg.force_shapes and index == 0
        self.pending_forced_compressions = {"main", "sub-1"} if self.forced else set()
        last_execution = index == cfg.n_problems * cfg.group_size - 1
        timed_out = rng.random() < cfg.p_timeout or (cfg.force_shapes and last_execution)
        started_at = BASE_EPOCH + float(rng.uniform(0.0, 60.0))  # one step's executions run together
        self.clock, self.n_subagents, self.calls = started_at, 0, []
        self.policy_version = int(rng.integers(0, 3))  # async rollouts start a little stale
        self.engine_index = int(rng.integers(0, N_ENGINES))
        n_turns = _lognormal_int(rng, max(2, cfg.max_turns // 4), cfg.max_turns, 0.4 * cfg.max_turns, 0.6)
        if self.forced:
            n_turns = max(n_turns, 4)  # room for the forced delegation, retry and compression
        self.run_agent("main", np.concatenate([self.harness.system, instruction]), n_turns)
        if timed_out:
            self.calls[-1]["finish_reason"] = "length"  # the harness cut the last call short
            reward, reward_source = round(float(rng.uniform(0.0, 0.6)), 3), "workspace_snapshot"
            ended_at = self.clock + float(rng.uniform(1.0, 5.0))
        else:
            reward = float(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], p=[0.4, 0.1, 0.1, 0.1, 0.3]))
            reward_source, ended_at = "final", self.clock + float(rng.uniform(5.0, 30.0))  # grading
        execution = {
            "type": "execution",
            "execution_id": self.execution_id,
            "problem_id": f"p{problem}",
            "group_id": f"g{problem}",
            "status": "timeout" if timed_out else "completed",
            "reward": reward,
            "reward_source": reward_source,
            "harness": "synth",
            "started_at": round(started_at, 6),
            "ended_at": round(ended_at, 6),
            "n_calls": len(self.calls),
        }
        return [execution, *self.calls]

    # -- token draws ---------------------------------------------------------------------------
    def _tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.cfg.vocab_size, size=n, dtype=np.int32)

    def _output_len(self) -> int:
        lo, hi = self.cfg.output_tokens
        if self.rng.random() < LONG_OUTPUT_PROBABILITY:
            return int(self.rng.integers(hi, hi * LONG_OUTPUT_FACTOR + 1))
        return _lognormal_int(self.rng, lo, hi, lo + 0.15 * (hi - lo), 0.6)

    def _summary_len(self) -> int:
        lo, hi = self.cfg.summary_tokens
        return int(self.rng.integers(lo, hi + 1))

    def _tool_result(self) -> np.ndarray:
        lo, hi = self.cfg.tool_result_tokens
        return self._tokens(_lognormal_int(self.rng, lo, hi, lo + 0.1 * (hi - lo), 1.0))

    def _retried_output(self, failed: np.ndarray, draw_len: Callable[[], int]) -> np.ndarray:
        """Same opening as the failed output for k tokens then a divergence, or all different."""
        keep = int(self.rng.integers(1, len(failed))) if len(failed) > 1 and self.rng.random() < 0.5 else 0
        fresh = self._tokens(max(draw_len(), keep + 1) - keep)
        if keep < len(failed) and fresh[0] == failed[keep]:  # make the divergence point real
            fresh[0] = (fresh[0] + 1) % self.cfg.vocab_size
        return np.concatenate([failed[:keep], fresh])

    # -- calls ---------------------------------------------------------------------------------
    def _record(self, agent_id: str, role: str, prompt: np.ndarray, output: np.ndarray, finish: str) -> None:
        if self.rng.random() < POLICY_UPDATE_PROBABILITY:
            self.policy_version += 1
            if self.rng.random() < 0.5:  # the execution migrated to another engine with the update
                self.engine_index = (self.engine_index + 1) % N_ENGINES
        logprobs = -np.abs(self.rng.normal(0.0, 0.8, size=len(output))).astype(np.float32)
        t_start = self.clock + float(self.rng.uniform(0.01, 0.2))  # queueing
        # Prefill (mostly prefix-cached) plus decode time.
        t_end = t_start + 0.05 + len(prompt) * 2e-6 + len(output) * float(self.rng.uniform(0.01, 0.03))
        self.clock = t_end
        self.calls.append(
            {
                "type": "call",
                "execution_id": self.execution_id,
                "call_id": len(self.calls),
                "agent_id": agent_id,
                "role": role,
                "prompt_ids": prompt,
                "output_ids": output,
                "output_logprobs": logprobs,
                "policy_version": self.policy_version,
                "engine_id": f"engine-{self.engine_index}",
                "finish_reason": finish,
                "t_start": round(t_start, 6),
                "t_end": round(t_end, 6),
            }
        )

    def _call(
        self,
        agent_id: str,
        role: str,
        prompt: np.ndarray,
        draw_len: Callable[[], int],
        force_retry: bool = False,
    ) -> np.ndarray:
        """One model call (and its retry, if it fails); returns the output the agent continues from."""
        output = self._tokens(draw_len())
        if force_retry or self.rng.random() < self.cfg.p_retry:
            self._record(agent_id, role, prompt, output, "length" if self.rng.random() < 0.5 else "stop")
            output = self._retried_output(output, draw_len)
            prompt = prompt.copy()  # the retry's record owns its prompt
        self._record(agent_id, role, prompt, output, "stop")
        return output

    def _tool_latency(self) -> None:
        self.clock += float(np.clip(self.rng.lognormal(np.log(2.0), 1.0), 0.05, 600.0))

    # -- agents --------------------------------------------------------------------------------
    def run_agent(self, agent_id: str, base: np.ndarray, n_turns: int) -> np.ndarray:
        """Runs a multi-turn agent from context ``base``; returns its final output."""
        is_main = agent_id == "main"
        role, summary_role = ("main", "main_summary") if is_main else ("sub", "sub_summary")
        context = base
        for turn in range(n_turns):
            force_retry = is_main and self.forced and turn == 2
            output = self._call(agent_id, role, context, self._output_len, force_retry)
            if turn == n_turns - 1:
                return output
            delegate = is_main and ((self.forced and turn == 1) or self.rng.random() < self.cfg.p_subagent)
            if delegate:
                observation = np.concatenate([self.harness.sub_result_header, self._run_subagent(output)])
            else:
                self._tool_latency()
                observation = self._tool_result()
            force_compress = agent_id in self.pending_forced_compressions and turn >= n_turns // 2
            if force_compress or len(context) + len(output) + len(observation) > self.context_budget:
                summary_prompt = np.concatenate([context, output, self.harness.summarize_instruction])
                summary = self._call(agent_id, summary_role, summary_prompt, self._summary_len)
                restart = np.concatenate([base, self.harness.summary_header, summary])
                # A tool result that still does not fit is truncated, as harnesses do.
                observation = observation[: max(0, self.context_budget - len(restart))]
                context = np.concatenate([restart, observation])
                self.pending_forced_compressions.discard(agent_id)
            else:
                context = np.concatenate([context, output, observation])
        return np.empty(0, dtype=np.int32)  # n_turns == 0

    def _run_subagent(self, delegating_output: np.ndarray) -> np.ndarray:
        """A sub-agent works on a slice of the delegating output; returns its final output."""
        self.n_subagents += 1
        start = int(self.rng.integers(0, max(1, len(delegating_output) // 2)))
        subtask = delegating_output[start:].copy()
        max_sub_turns = max(3, self.cfg.max_turns // 4)
        n_turns = _lognormal_int(self.rng, 2, max_sub_turns, max(2.0, max_sub_turns / 8), 0.9)
        if self.forced and self.n_subagents == 1:
            n_turns = max(n_turns, 4)  # room for its forced compression
        return self.run_agent(
            f"sub-{self.n_subagents}", np.concatenate([self.harness.sub_system, subtask]), n_turns
        )


def generate(cfg: SynthConfig) -> Iterator[dict[str, Any]]:
    """Yields, per execution, its execution record then its call records in call order."""
    rng = np.random.default_rng(cfg.seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, cfg.vocab_size, size=n, dtype=np.int32)

    harness = _HarnessTokens(
        system=tokens(cfg.system_tokens),
        sub_system=tokens(max(1, cfg.system_tokens // 2)),
        summarize_instruction=tokens(SUMMARIZE_INSTRUCTION_TOKENS),
        summary_header=tokens(SUMMARY_HEADER_TOKENS),
        sub_result_header=tokens(SUB_RESULT_HEADER_TOKENS),
    )
    builder = _ExecutionBuilder(cfg, rng, harness)
    for problem in range(cfg.n_problems):
        instruction = tokens(cfg.instruction_tokens)  # shared by the problem's group
        for k in range(cfg.group_size):
            yield from builder.simulate(problem, k, instruction)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Writes one JSON object per line (numpy arrays as lists); returns the number of lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_lines = 0
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, default=_jsonable, separators=(",", ":")))
            f.write("\n")
            n_lines += 1
    return n_lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a synthetic agent-execution trace as JSONL.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="sample")
    parser.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    parser.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    args = parser.parse_args(argv)
    cfg = preset(args.preset)
    if args.seed is not None:
        cfg = replace(cfg, seed=args.seed)
    started = time.perf_counter()
    n_lines = write_jsonl(generate(cfg), args.out)
    size_kb = args.out.stat().st_size / 1024
    print(
        f"wrote {n_lines} records ({size_kb:.0f} KB) to {args.out} in {time.perf_counter() - started:.2f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
