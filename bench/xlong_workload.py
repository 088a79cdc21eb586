"""The xLong workload (bench/xlong.py): the policy copy it runs, and the scripted harness that drives its group.

`policy_copy` gives the shipped warm start a RoPE table of POSITIONS. `Texts` makes tool outputs of a
given token count (source files, logs); `Harness` makes the calls of one execution on the official
``openai`` client through the gateway and keeps its `HarnessLog`; `drive` is the xLong execution (big
reads up to CONTEXT_SHARE of the goal, a summary, then small turns with sub-agents and a branch every
BRANCH_EVERY turns), and `run_group` registers, drives and finishes it beside its short sibling.
bench/xlong_stages.py runs it as the rollout stage.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from environments.gateway_admin import GatewayAdmin

POLICY = "data/policies/tiny-sft"
POSITIONS = 262_144  # the policy copy's RoPE table: contexts past 128K
CONTEXT_SHARE = 0.128  # the main agent's context grows to this share of the tokens to touch
BIG_READS = 8  # tool outputs that take the main agent's context there
SMALL_OUTPUT = (60, 2000, 250.0)  # clipped lognormal tool output of a small turn: lo, hi, median
SUB_TURNS = (6, 12)
SUB_EVERY_READS = 3  # during the reads, a sub-agent after every third one
MAIN_MAX_TOKENS, SUB_MAX_TOKENS, SUMMARY_MAX_TOKENS = 48, 32, 256
BRANCH_EVERY = 5
SYSTEM = "You are a coding agent working in a large repository. Use the tools, then answer."
SUB_SYSTEM = "You are a sub-agent. Do the one task you are given, then report in one line."
TASK = "The nightly build fails in the parser package. Find the cause, fix it and make the tests pass."
WORDS = (
    "parser",
    "token",
    "stream",
    "buffer",
    "offset",
    "config",
    "loader",
    "cache",
    "index",
    "record",
    "batch",
    "flush",
    "writer",
    "reader",
    "session",
    "context",
    "prefix",
    "tree",
    "node",
    "path",
    "depth",
    "branch",
    "merge",
    "commit",
    "retry",
    "timeout",
    "worker",
    "engine",
    "gateway",
    "policy",
    "version",
    "weight",
    "step",
    "group",
    "reward",
    "sample",
    "decode",
    "prefill",
    "window",
    "limit",
    "shard",
    "chunk",
)


def policy_copy(folder: str) -> str:
    """The shipped warm start with a RoPE table of POSITIONS (positions are computed, not learned:
    the weights are unchanged; the policy was trained on short contexts)."""
    shutil.copytree(POLICY, folder, dirs_exist_ok=True)
    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = POSITIONS
    config_path.write_text(json.dumps(config, indent=1))
    return folder


class Texts:
    """Tool outputs of a given token count (the policy's tokenizer counts them): source files, logs."""

    def __init__(self, tokenizer, rng: random.Random) -> None:
        self.tokenizer, self.rng = tokenizer, rng

    def _line(self, kind: str, i: int) -> str:
        w = self.rng.sample(WORDS, 4)
        n = self.rng.randrange(1000)
        if kind == "file":
            return f"{i:5d}    def {w[0]}_{w[1]}(self, {w[2]}): return self.{w[3]}[{n}]"
        return f"[{i * 0.137:09.3f}] {self.rng.choice(('INFO', 'WARN', 'DEBUG'))} {w[0]}.{w[1]}: {w[2]} {w[3]} {n}"

    def make(self, tokens: int, kind: str) -> str:
        lines, count = [], 0
        while count < tokens:
            line = self._line(kind, len(lines))
            count += len(self.tokenizer.encode(line + "\n", add_special_tokens=False))
            lines.append(line)
        return "\n".join(lines)

    def small(self) -> str:
        lo, hi, median = SMALL_OUTPUT
        tokens = int(min(hi, max(lo, self.rng.lognormvariate(math.log(median), 0.9))))
        return self.make(tokens, "log")


@dataclass
class HarnessLog:
    """What the harness saw of one execution, from the gateway's answers."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_prompt_tokens: int = 0
    roles: Counter = field(default_factory=Counter)
    agents: set = field(default_factory=set)
    branches: int = 0
    summaries: int = 0

    @property
    def touched(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Harness:
    def __init__(self, client: AsyncOpenAI, texts: Texts, log: HarnessLog) -> None:
        self.client, self.texts, self.log = client, texts, log
        self.seed = 0
        self.main_prompt = 0  # the main agent's last prompt: its context now

    async def call(self, messages: list[dict], agent: str, role: str, max_tokens: int) -> dict:
        self.seed += 1
        completion = await self.client.chat.completions.create(
            model="gyre-policy",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            seed=self.seed,
            extra_headers={"X-Gyre-Agent": agent, "X-Gyre-Role": role},
        )
        usage = completion.usage
        assert usage is not None, "the gateway reports usage on every completion"
        self.log.calls += 1
        self.log.prompt_tokens += usage.prompt_tokens
        self.log.completion_tokens += usage.completion_tokens
        self.log.max_prompt_tokens = max(self.log.max_prompt_tokens, usage.prompt_tokens)
        self.log.roles[role] += 1
        if agent == "main":
            self.main_prompt = usage.prompt_tokens
        self.log.agents.add(agent)
        return completion.choices[0].message.model_dump(exclude_none=True)

    @staticmethod
    def follow(messages: list[dict], reply: dict, output: str) -> None:
        """The reply and what the tools answered: ``output`` for its first tool call (or as the user's
        next message when it called none), "ok" for the others."""
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        for i, call in enumerate(calls):
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": output if i == 0 else "ok"}
            )
        if not calls:
            messages.append({"role": "user", "content": "Tool output:\n" + output})

    async def sub_agent(self, index: int, goal: int) -> str:
        agent = f"sub-{index}"
        messages = [
            {"role": "system", "content": SUB_SYSTEM},
            {"role": "user", "content": f"Task {index}: check {self.texts.rng.choice(WORDS)} in the parser."},
        ]
        reply: dict = {}
        for _ in range(self.texts.rng.randint(*SUB_TURNS)):
            if self.log.touched >= goal:
                break
            reply = await self.call(messages, agent, "sub", SUB_MAX_TOKENS)
            self.follow(messages, reply, self.texts.small())
        return str(reply.get("content") or "done")

    async def summarize(self, messages: list[dict]) -> list[dict]:
        """Context compression: a summary call, then the conversation starts again from it."""
        asked = [
            *messages,
            {"role": "user", "content": "Summarize what you found so far for your successor."},
        ]
        summary = await self.call(asked, "main", "main_summary", SUMMARY_MAX_TOKENS)
        self.log.summaries += 1
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{TASK}\n\nWhat was found so far:\n{summary.get('content') or ''}"},
        ]


async def drive(client: AsyncOpenAI, texts: Texts, goal: int, branch_every: int = BRANCH_EVERY) -> HarnessLog:
    """One xLong execution: reads until the context passes CONTEXT_SHARE * goal, a summary, then small
    turns with sub-agents (and a branch every ``branch_every`` turns) until ``goal`` tokens are touched."""
    log = HarnessLog()
    harness = Harness(client, texts, log)
    context = int(CONTEXT_SHARE * goal)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    subs = 0
    for read in range(BIG_READS):
        reply = await harness.call(messages, "main", "main", MAIN_MAX_TOKENS)
        harness.follow(messages, reply, texts.make(context // BIG_READS, "file"))
        if read % SUB_EVERY_READS == SUB_EVERY_READS - 1:
            subs += 1
            await harness.sub_agent(subs, goal)
    messages = await harness.summarize(messages)
    turn = 0
    while turn == 0 or log.touched < goal:  # at least one turn after the summary
        turn += 1
        if turn % branch_every == 0:  # a retry: the same context asked again, the first answer dropped
            await harness.call(messages, "main", "main", MAIN_MAX_TOKENS)
            log.branches += 1
        reply = await harness.call(messages, "main", "main", MAIN_MAX_TOKENS)
        subs += 1
        report = await harness.sub_agent(subs, goal)
        harness.follow(messages, reply, texts.small() + f"\nsub-agent {subs}: {report}")
        if harness.main_prompt > context:
            messages = await harness.summarize(messages)
    return log


async def _sibling(client: AsyncOpenAI, texts: Texts) -> HarnessLog:
    """The group's other execution: three small main turns."""
    log = HarnessLog()
    harness = Harness(client, texts, log)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for _ in range(3):
        reply = await harness.call(messages, "main", "main", MAIN_MAX_TOKENS)
        harness.follow(messages, reply, texts.small())
    return log


async def run_group(
    gateway_url: str, admin_token: str, goal: int, tokenizer, seed: int, branch_every: int = BRANCH_EVERY
) -> dict[str, HarnessLog]:
    """Registers, drives and finishes the group: the xLong execution (reward 1) and its sibling (0)."""
    texts = Texts(tokenizer, random.Random(seed))
    logs: dict[str, HarnessLog] = {}
    async with httpx.AsyncClient() as http:
        admin = GatewayAdmin(gateway_url, admin_token, http)
        for execution_id, reward, driven in (("xlong", 1.0, True), ("sibling", 0.0, False)):
            registration = await admin.register(execution_id, problem_id="xlong", group_id="xlong", step=0)
            async with AsyncOpenAI(
                base_url=registration["base_url"],
                api_key=registration["api_key"],
                max_retries=0,
                timeout=3600,
            ) as client:
                logs[execution_id] = await (
                    drive(client, texts, goal, branch_every) if driven else _sibling(client, texts)
                )
            await admin.finish(execution_id, "completed", reward=reward, reward_source="final")
    return logs
