"""xLong for real (issue 37): one execution that touches up to a million tokens, end to end.

    gyre bench xlong            # executions touching 64K, 256K and 1M tokens
    gyre bench xlong --quick    # 64K and 256K
    python -m bench.xlong [--quick] [--sizes 65536,262144] [--out bench/results/xlong.json]
    gyre bench xlong --only snapshot   # the snapshot stage alone, for every size of --out

Per size, one group of two executions runs through the real stack (tasks/services/stack.py: one
rollout engine process, two torch threads, and the gateway, which records every call to Parquet):

- the xLong execution, a scripted harness (``drive``) on the official ``openai`` client. Its main
  agent reads large files until its context passes ``CONTEXT_SHARE`` of the tokens to touch (134K
  at 1M), in ``BIG_READS`` tool outputs; compresses it with a summary call (role main_summary: the
  conversation starts again from the summary, a new root); then works in small turns (tool outputs
  of 60-2,000 tokens, lognormal), each followed by a sub-agent of 6-12 turns in its own context
  (its own tree), until the tokens touched reach the size. Every ``BRANCH_EVERY``-th main turn is
  asked twice with different seeds (a retry: a branch in the tree). Tokens touched = the sum of
  every call's prompt and completion tokens, as the gateway's usage reports them.
- a short sibling execution of the same problem (reward 0 against the xLong one's 1), so the group
  has a signal and the loss a gradient. The harness is scripted, not graded: the rewards are fixed.

Each later stage runs in a process of its own, so its peak resident memory (``ru_maxrss``) is its
own: ``tree`` (the DuckDB views: tree nodes, trajectories, role-priority selection, training
tokens, with DuckDB's memory_limit set to ``DUCKDB_MEMORY_LIMIT`` and a spill folder, through
StoreConfig). The selection takes every trajectory (j_max ``SELECT_ALL``), so the training tree is
the whole execution; what the default selection (j_max 5, main > sub > main_summary) would train is
reported beside it (``default_selection_*``): it leaves out the context a summary compressed, whose
leaf is the summary call. Then ``pack``
(trajectory_store.processor.pack into sequences of at most max(longest path + 1, ``PIECE_BUDGET``)
tokens: a tree larger than that is split into pieces that repeat the ancestors they need, as
context only), ``train`` (the trainer's own GradWorker: forward and backward of every packed
sequence with the tree kernel), ``snapshot`` (a workspace of ``SNAPSHOT_BYTES_PER_TOKEN`` a token
touched stored as snapshot rows and blobs, then written back as the grader does). The rollout's
memory is read from the engine's and the gateway's /proc VmHWM (the gateway's is the recording's:
it streams calls to Parquet parts).

Across sizes: each stage's growth exponent of time and of memory (log-log slope from the smallest
to the largest size). On the smallest size's group: the tree loss and gradient trained in one piece
against the same trees trained in pieces (``piecewise_*_rel_diff``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow.parquet as pq
from openai import AsyncOpenAI

from engines.admin import AdminClient
from environments.gateway_admin import GatewayAdmin
from tasks.services.stack import local_stack
from trajectory_store import db
from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.storage import Store, StoreConfig

DEFAULT_OUT = "bench/results/xlong.json"
POLICY = "data/policies/tiny-sft"
POSITIONS = 262_144  # the policy copy's RoPE table: contexts past 128K
SIZES = (65_536, 262_144, 1_048_576)
QUICK_SIZES = SIZES[:2]
CONTEXT_SHARE = 0.128  # the main agent's context grows to this share of the tokens to touch
BIG_READS = 8  # tool outputs that take the main agent's context there
SMALL_OUTPUT = (60, 2000, 250.0)  # clipped lognormal tool output of a small turn: lo, hi, median
SUB_TURNS = (6, 12)
SUB_EVERY_READS = 3  # during the reads, a sub-agent after every third one
MAIN_MAX_TOKENS, SUB_MAX_TOKENS, SUMMARY_MAX_TOKENS = 48, 32, 256
BRANCH_EVERY = 5
ENGINE_THREADS = 2
DUCKDB_MEMORY_LIMIT = "1GB"
PIECE_BUDGET = 16_384
SELECT_ALL = 1_000_000  # j_max: every trajectory of the execution is trained
SNAPSHOT_BYTES_PER_TOKEN = 512  # the timed-out workspace snapshotted: about 0.5-0.65 GB at 1M touched
SNAPSHOT_FILE_BYTES = 256 << 10
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


# the workload ------------------------------------------------------------------------------------
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


def _hwm_gb(pid: int) -> float:
    """A live process's peak resident memory (/proc VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no VmHWM for process {pid}")


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# the stages --------------------------------------------------------------------------------------
def stage_rollout(work: str, goal: int, seed: int) -> dict[str, Any]:
    from engines.model.loading import load_tokenizer

    policy = policy_copy(os.path.join(work, "policy"))
    store = StoreConfig(data_root=os.path.join(work, "store"), campaign="xlong")
    tokenizer = load_tokenizer(policy)
    started = time.perf_counter()
    with local_stack(policy, store, threads=ENGINE_THREADS, dtype="float32") as stack:
        stack_s = time.perf_counter() - started
        started = time.perf_counter()
        logs = asyncio.run(run_group(stack.gateway_url, stack.admin_token, goal, tokenizer, seed))
        harness_s = time.perf_counter() - started
        with AdminClient(stack.gateway_url, stack.admin_token) as admin:
            admin.flush()
            gateway = admin.gateway_stats()
        engine_url = stack.engine_urls[0]
        with AdminClient(engine_token=stack.engine_admin_token) as admin:
            engine = admin.engine_stats(engine_url)
        engine_gb = _hwm_gb(stack.processes[engine_url].pid)
        gateway_gb = _hwm_gb(stack.processes[stack.gateway_url].pid)
    xlong = logs["xlong"]
    touched = sum(log.touched for log in logs.values())
    return {
        "stack_start_s": stack_s,
        "s": harness_s,
        "calls": xlong.calls,
        "tokens_touched": xlong.touched,
        "group_tokens_touched": touched,
        "prompt_tokens": xlong.prompt_tokens,
        "completion_tokens": xlong.completion_tokens,
        "max_context_tokens": xlong.max_prompt_tokens,
        "roles": dict(xlong.roles),
        "agents": len(xlong.agents),
        "branches": xlong.branches,
        "summaries": xlong.summaries,
        "tokens_per_s": touched / harness_s,
        "engine_prefilled_tokens": engine.prefilled_tokens,
        "engine_cached_tokens": engine.cached_tokens,
        "engine_recomputed_tokens": engine.recomputed_tokens,
        "engine_decoded_tokens": engine.decoded_tokens,
        "engine_peak_rss_gb": engine_gb,
        "gateway_peak_rss_gb": gateway_gb,
        "gateway_reused_prompt_tokens": gateway.reused_prompt_tokens,
        "gateway_tokenized_prompt_tokens": gateway.tokenized_prompt_tokens,
        "harness_peak_rss_gb": _rss_gb(),
    }


def _connect(work: str, selection: SelectionConfig | None = None):
    """The store's views with DuckDB's memory limit and spill folder set (StoreConfig), selecting every
    trajectory by default: the training tree is then the whole execution."""
    store = StoreConfig(
        data_root=os.path.join(work, "store"),
        campaign="xlong",
        duckdb_memory_limit=DUCKDB_MEMORY_LIMIT,
        duckdb_temp_directory=os.path.join(work, "duckdb-spill"),
    )
    return db.connect(Store(store), selection or SelectionConfig(j_max=SELECT_ALL))


TREE_QUERIES = {
    "tree_nodes": "SELECT count(*), sum(n_tokens), sum(n_tokens) FILTER (WHERE is_policy) FROM tree_nodes",
    "trajectories": "SELECT count(*) FROM trajectories",
    "selected_trajectories": "SELECT count(*), max(n_tokens) FROM selected_trajectories",
    "training_tokens": "SELECT count(*), sum(weight) FROM training_tokens",
}


def stage_tree(work: str) -> dict[str, Any]:
    con = _connect(work)
    started = time.perf_counter()
    results = {name: con.execute(sql).fetchall()[0] for name, sql in TREE_QUERIES.items()}
    seconds = time.perf_counter() - started
    con.close()
    con = _connect(work, SelectionConfig())  # what a campaign's default selection would train
    default = con.execute(TREE_QUERIES["selected_trajectories"]).fetchall()[0]
    default_tokens = con.execute(TREE_QUERIES["training_tokens"]).fetchall()[0][0]
    con.close()
    nodes, tokens, policy = results["tree_nodes"]
    return {
        "s": seconds,
        "tree_nodes": nodes,
        "unique_tokens": int(tokens),
        "policy_tokens": int(policy or 0),
        "trajectories": results["trajectories"][0],
        "selected_trajectories": results["selected_trajectories"][0],
        "longest_selected_tokens": int(results["selected_trajectories"][1] or 0),
        "training_tokens": results["training_tokens"][0],
        "default_selection_trajectories": default[0],
        "default_selection_longest_tokens": int(default[1] or 0),
        "default_selection_training_tokens": default_tokens,
        "tokens_per_s": int(tokens) / seconds,
        "duckdb_memory_limit": DUCKDB_MEMORY_LIMIT,
    }


def stage_pack(work: str, budget: int | None = None, out: str = "packed.parquet") -> dict[str, Any]:
    from trajectory_store.processor import batch_to_table, pack

    con = _connect(work)
    longest = int(
        con.execute("SELECT coalesce(max(n_tokens), 0) FROM selected_trajectories").fetchall()[0][0]
    )
    budget = budget or max(longest + 1, PIECE_BUDGET)
    started = time.perf_counter()
    batch = pack(con, PackingConfig(token_budget=budget))
    seconds = time.perf_counter() - started
    con.close()
    pq.write_table(batch_to_table(batch, step=0), os.path.join(work, out))
    return {
        "s": seconds,
        "token_budget": budget,
        "sequences": len(batch.sequences),
        "longest_sequence": max((len(s) for s in batch.sequences), default=0),
        "tokens": batch.n_tokens,
        "unique_tokens": batch.n_unique_tokens,
        "target_tokens": batch.n_target_tokens,
        "repeated_tokens": batch.n_repeated_tokens,
        "executions": len(batch.advantages),
        "tokens_per_s": batch.n_unique_tokens / seconds,
    }


def stage_train(work: str, packed: str = "packed.parquet", grad_out: str | None = None) -> dict[str, Any]:
    import torch

    from engines.model.weights import load_model
    from engines.train.config import LossConfig
    from engines.train.worker import GradWorker
    from trajectory_store.processor import table_to_sequences

    torch.set_num_threads(ENGINE_THREADS)
    sequences = table_to_sequences(pq.read_table(os.path.join(work, packed)))
    executions = {e for s in sequences for e in s.executions}
    worker = GradWorker(load_model(os.path.join(work, "policy"), dtype=torch.float32), LossConfig())
    started = time.perf_counter()
    loss = 0.0
    for index, sequence in enumerate(sequences):
        loss += worker.accumulate(sequence, len(executions), index, 0).loss
    seconds = time.perf_counter() - started
    if grad_out:
        np.save(os.path.join(work, grad_out), worker.grad.numpy())
    tokens = sum(len(s) for s in sequences)
    return {
        "s": seconds,
        "sequences": len(sequences),
        "tokens": tokens,
        "loss": loss,
        "grad_norm": float(worker.grad.norm()),
        "tokens_per_s": tokens / seconds,
    }


def tree_loss(work: str, packed: str) -> float:
    """The packed trees' loss as a likelihood: -sum over targets of weight x log p (each execution's
    mean token NLL, summed). The policy loss of this group is no check: its two executions' advantages
    (+1, -1) cancel it to float noise at the behaviour policy."""
    import torch

    from engines.model.weights import load_model
    from engines.train.tree import target_logprobs
    from trajectory_store.processor import table_to_sequences

    torch.set_num_threads(ENGINE_THREADS)
    model = load_model(os.path.join(work, "policy"), dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for sequence in table_to_sequences(pq.read_table(os.path.join(work, packed))):
            out = target_logprobs(model, sequence)
            weights = torch.as_tensor(sequence.weights[out.targets.numpy()], dtype=torch.float64)
            total -= float((weights * out.logprobs.double()).sum())
    return total


def stage_piecewise(work: str) -> dict[str, Any]:
    """The same trees trained in one piece and in pieces of the longest path: loss and gradient."""
    whole = stage_pack(work, budget=10**9, out="whole.parquet")
    con = _connect(work)
    longest = int(
        con.execute("SELECT coalesce(max(n_tokens), 0) FROM selected_trajectories").fetchall()[0][0]
    )
    con.close()
    pieces = stage_pack(work, budget=longest + 1, out="pieces.parquet")
    one = stage_train(work, "whole.parquet", grad_out="whole-grad.npy")
    split = stage_train(work, "pieces.parquet", grad_out="pieces-grad.npy")
    g1, g2 = np.load(os.path.join(work, "whole-grad.npy")), np.load(os.path.join(work, "pieces-grad.npy"))
    loss_one, loss_pieces = tree_loss(work, "whole.parquet"), tree_loss(work, "pieces.parquet")
    return {
        "one_piece_sequences": whole["sequences"],
        "pieces": pieces["sequences"],
        "piece_budget": pieces["token_budget"],
        "repeated_tokens": pieces["repeated_tokens"],
        "one_piece_tree_loss": loss_one,
        "pieces_tree_loss": loss_pieces,
        "loss_rel_diff": abs(loss_one - loss_pieces) / abs(loss_one),
        "one_piece_policy_loss": one["loss"],
        "pieces_policy_loss": split["loss"],
        "grad_rel_diff": float(np.linalg.norm(g1 - g2) / max(np.linalg.norm(g1), 1e-30)),
        "one_piece_s": one["s"],
        "pieces_s": split["s"],
    }


def stage_snapshot(work: str, workspace_bytes: int) -> dict[str, Any]:
    """A timed-out execution's workspace of ``workspace_bytes`` (source-like files of 256 KB) stored
    as snapshot rows and blobs, then written back into a fresh folder as grading does."""
    from environments.snapshot_rows import materialise, store_workspace
    from trajectory_store.snapshots import SnapshotStore

    workspace = Path(work, "workspace")
    rng = random.Random(workspace_bytes)
    for i in range(max(1, workspace_bytes // SNAPSHOT_FILE_BYTES)):
        lines = (
            f"{j:6d} {rng.choice(WORDS)}_{rng.choice(WORDS)} = {rng.randrange(10**6)}\n" for j in range(10**9)
        )
        text = "".join(next(lines) for _ in range(SNAPSHOT_FILE_BYTES // 24))
        path = workspace / f"pkg{i % 16}" / f"module_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    size = sum(p.stat().st_size for p in workspace.rglob("*") if p.is_file())
    store = Store(StoreConfig(data_root=os.path.join(work, "snapshots"), campaign="xlong"))
    started = time.perf_counter()
    uri = store_workspace(SnapshotStore(store), 0, "xlong", workspace, problem_id="xlong")
    store_s = time.perf_counter() - started
    started = time.perf_counter()
    snapshots = SnapshotStore(store)
    written = materialise(snapshots, snapshots.read(uri).entries, Path(work, "restored"))
    restore_s = time.perf_counter() - started
    shutil.rmtree(workspace)
    shutil.rmtree(Path(work, "restored"))
    return {
        "s": store_s + restore_s,
        "store_s": store_s,
        "restore_s": restore_s,
        "workspace_bytes": size,
        "files": len(written),
        "bytes_per_s": 2 * size / (store_s + restore_s),
    }


STAGES = {"tree": stage_tree, "pack": stage_pack, "train": stage_train, "piecewise": stage_piecewise}


def run_stage(name: str, work: str, *args: Any) -> dict[str, Any]:
    """Runs a stage in a process of its own; its figures with its peak resident memory."""
    result = os.path.join(work, f"stage-{name}.json")
    command = [sys.executable, "-m", "bench.xlong", "--stage", name, "--work", work, "--result", result]
    command += [str(a) for a in args]
    subprocess.run(command, check=True)
    return json.loads(Path(result).read_text())


def _stage_main(name: str, work: str, result: str, args: list[str]) -> int:
    if name == "rollout":
        figures = stage_rollout(work, int(args[0]), int(args[1]))
    elif name == "snapshot":
        figures = stage_snapshot(work, int(args[0]))
    else:
        figures = STAGES[name](work)
    figures.setdefault("peak_rss_gb", _rss_gb())
    Path(result).write_text(json.dumps(figures))
    return 0


# the run -----------------------------------------------------------------------------------------
def stored_bytes(work: str, unique: int, policy: int) -> dict[str, Any]:
    """Bytes of the stored calls over 4 B per unique token id + 4 B per policy logprob."""
    store = Store(StoreConfig(data_root=os.path.join(work, "store"), campaign="xlong"))
    table = store.read_table("calls")
    parquet = sum(store.fs.size(p) for p in store.visible_parts("calls"))
    floor = 4 * unique + 4 * policy
    return {
        "stored_bytes": table.nbytes,
        "parquet_bytes": parquet,
        "stored_over_unique": table.nbytes / floor,
        "parquet_over_unique": parquet / floor,
    }


def run_size(goal: int, root: str, seed: int, piecewise: bool) -> dict[str, Any]:
    work = os.path.join(root, f"touched-{goal}")
    os.makedirs(work, exist_ok=True)
    started = time.perf_counter()
    figures: dict[str, Any] = {"goal_tokens_touched": goal}
    stages = {"rollout": run_stage("rollout", work, goal, seed)}
    for name in ("tree", "pack", "train", "snapshot"):
        args = [goal * SNAPSHOT_BYTES_PER_TOKEN] if name == "snapshot" else []
        stages[name] = run_stage(name, work, *args)
        print(
            f"  {goal:>9,} {name:<8} {stages[name]['s']:8.1f} s  {stages[name]['peak_rss_gb']:6.2f} GB",
            flush=True,
        )
    rollout = stages["rollout"]
    figures.update(
        tokens_touched=rollout["tokens_touched"],
        calls=rollout["calls"],
        max_context_tokens=rollout["max_context_tokens"],
        unique_tokens=stages["tree"]["unique_tokens"],
        unique_over_touched=stages["tree"]["unique_tokens"] / rollout["group_tokens_touched"],
        **stored_bytes(work, stages["tree"]["unique_tokens"], stages["tree"]["policy_tokens"]),
        stages=stages,
    )
    # the recording runs in the gateway (it streams calls to Parquet parts): its process is the store stage
    stages["store"] = {"s": rollout["s"], "peak_rss_gb": rollout["gateway_peak_rss_gb"]}
    stages["engine"] = {"s": rollout["s"], "peak_rss_gb": rollout["engine_peak_rss_gb"]}
    if piecewise:
        figures["piecewise"] = run_stage("piecewise", work)
    figures["wall_s"] = time.perf_counter() - started
    shutil.rmtree(os.path.join(work, "store"), ignore_errors=True)
    return figures


def add_snapshots(out: str) -> dict[str, Any]:
    """The snapshot stage alone for every size of an existing result file, its rows replaced."""
    figures = json.loads(Path(out).read_text())
    with tempfile.TemporaryDirectory(prefix="gyre-xlong-") as root:
        for size in figures["sizes"]:
            work = os.path.join(root, f"touched-{size['goal_tokens_touched']}")
            os.makedirs(work)
            size["stages"]["snapshot"] = run_stage(
                "snapshot", work, size["goal_tokens_touched"] * SNAPSHOT_BYTES_PER_TOKEN
            )
    return _summarized(figures["sizes"], figures)


def _summarized(results: list[dict[str, Any]], figures: dict[str, Any]) -> dict[str, Any]:
    """The cross-size figures: peak memory per stage and size, growth exponents."""
    figures["peak_rss_gb"] = {
        stage: {str(r["goal_tokens_touched"]): r["stages"][stage]["peak_rss_gb"] for r in results}
        for stage in results[-1]["stages"]
    }
    figures["growth"] = growth(results)
    return figures


def growth(sizes: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage, the log-log slope of time and of peak memory over tokens touched (smallest to largest)."""
    if len(sizes) < 2:
        return {}
    first, last = sizes[0], sizes[-1]
    span = math.log(last["tokens_touched"] / first["tokens_touched"])
    out = {}
    for stage in last["stages"]:
        a, b = first["stages"][stage], last["stages"][stage]
        out[stage] = {
            "time_exponent": math.log(b["s"] / a["s"]) / span,
            "memory_exponent": math.log(b["peak_rss_gb"] / a["peak_rss_gb"]) / span,
        }
    return out


def summary_lines(f: dict[str, Any]) -> list[str]:
    lines = []
    for size in f["sizes"]:
        s = size["stages"]
        lines.append(
            f"touched {size['tokens_touched']:>9,} ({size['calls']} calls, context up to "
            f"{size['max_context_tokens']:,}, unique {size['unique_tokens']:,}, stored/unique "
            f"{size['stored_over_unique']:.3f}x)"
        )
        for name in ("engine", "store", "tree", "pack", "train", "snapshot"):
            if name in s:
                lines.append(f"  {name:<8} {s[name]['s']:9.1f} s  peak {s[name]['peak_rss_gb']:6.2f} GB")
    for name, g in f["growth"].items():
        lines.append(f"growth {name:<7} time ^{g['time_exponent']:.2f}  memory ^{g['memory_exponent']:.2f}")
    p = f.get("piecewise")
    if p:
        lines.append(
            f"piecewise: {p['pieces']} pieces vs {p['one_piece_sequences']}: loss rel diff "
            f"{p['loss_rel_diff']:.2e}, grad rel diff {p['grad_rel_diff']:.2e}"
        )
    return lines


def run(sizes: list[int], seed: int = 0) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gyre-xlong-") as root:
        results = []
        for i, goal in enumerate(sizes):
            print(f"xlong: touching {goal:,} tokens", flush=True)
            results.append(run_size(goal, root, seed, piecewise=i == 0))
    figures = {
        "max_tokens_touched": max(r["tokens_touched"] for r in results),
        "max_context_tokens": max(r["max_context_tokens"] for r in results),
        "piecewise_loss_rel_diff": results[0]["piecewise"]["loss_rel_diff"],
        "piecewise_grad_rel_diff": results[0]["piecewise"]["grad_rel_diff"],
        "piecewise": results[0]["piecewise"],
        "stored_over_unique": results[-1]["stored_over_unique"],
        "stored_over_unique_smallest": results[0]["stored_over_unique"],
        "sizes": results,
        "engine_threads": ENGINE_THREADS,
        "machine": {"cpus": os.cpu_count()},
        "wall_s": time.perf_counter() - started,
    }
    return _summarized(results, figures)


def main(quick: bool = False, out: str = DEFAULT_OUT, sizes: list[int] | None = None, only: str = "") -> int:
    if only not in ("", "snapshot"):
        raise SystemExit(
            f"--only {only!r}: the one stage that can run alone on an existing --out is 'snapshot'"
        )
    figures = add_snapshots(out) if only else run(sizes or list(QUICK_SIZES if quick else SIZES))
    for line in summary_lines(figures):
        print(line)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    Path(out).write_text(json.dumps(figures, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", help="tokens touched, comma-separated (default: 64K, 256K, 1M)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--only", default="", help="'snapshot': that stage alone, for every size of --out")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    cli, rest = parser.parse_known_args()
    if cli.stage:
        sys.exit(_stage_main(cli.stage, cli.work, cli.result, rest))
    sys.exit(
        main(cli.quick, cli.out, [int(s) for s in cli.sizes.split(",")] if cli.sizes else None, cli.only)
    )
