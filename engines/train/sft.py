"""Supervised warm start: next-token training on the assistant turns of demonstration conversations.

A demonstration is an OpenAI-style message list (system, user, assistant turns with tool calls, tool
results) plus the tool list the harness declares. Each one is rendered with the policy's own chat
template, exactly as the gateway renders a live request, and only the assistant turns' tokens are
targets: the model learns to emit the template's ``<tool_call>`` blocks the gateway parses.

Every demonstration starts with the same system prompt and tool list (most of its tokens), so a batch
is trained as ONE prefix tree (engines.train.tree): shared tokens are computed once, and each target
token is weighted by how many demonstrations of the batch have it, which gives exactly the loss of
training the demonstrations one by one.

A model that starts from random weights has no in-context copying: after a warm start on
demonstrations alone the tiny policy writes the right operation with the wrong names (``rm
data/ideas.md`` for "Delete the file backup/todo.txt"). ``copy_steps`` first trains it on copy drills
(`copy_drills`: a random text, then the same text again; the second copy is the target), which is the
cheapest way to grow the induction heads a pretrained LLM brings with it. The drill texts are drawn
from the words the caller passes (the training problems' instructions), optionally with
``copy_corpus_words`` words of the tokenizer corpus.

Assistant spans are found by rendering the conversation up to each assistant turn with the
generation prompt and again with the turn: the tokens in between are that turn's (the template ends
every turn with <|im_end|>, so rendering a longer prefix never changes the tokens before it; this is
checked, not assumed).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engines.model.loading import load_tokenizer
from engines.model.weights import load_model
from engines.train.tree import target_logprobs
from trajectory_store.processor import PackedSequence


@dataclass
class SFTConfig:
    """One warm-start run."""

    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 8
    """Conversations per step (padded to the longest)."""
    lr: float = 2e-3
    """Peak learning rate (linear warm-up over warmup_steps, then cosine to 10%)."""
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_len: int = 1536
    """Conversations longer than this many tokens are cut (their tail turns are lost)."""
    seed: int = 0
    log_every: int = 25
    copy_steps: int = 0
    """Steps of copy drills before the demonstrations (0: none)."""
    copy_batch_size: int = 32
    """Copy drills per step."""
    copy_lr: float = 2e-3
    """Peak learning rate of the copy drills (same schedule shape)."""
    copy_corpus_words: int = 0
    """Words of the tokenizer corpus added to the drill vocabulary (the callers' words come first)."""


@dataclass
class Demonstration:
    token_ids: list[int]
    targets: list[bool]  # True on assistant-turn tokens


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Demonstration:
    """Token ids of a whole conversation and which of them the assistant produced (its turns marked
    ``"train": False`` excepted)."""

    def ids(prefix: list[dict[str, Any]], generation: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            prefix, tools=tools, tokenize=False, add_generation_prompt=generation
        )
        return tokenizer.encode(text, add_special_tokens=False)

    full = ids(messages, False)
    targets = [False] * len(full)
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("train") is False:
            continue  # a turn marked "train": False is context (a demonstrated mistake), not a target
        start = ids(messages[:index], True)
        end = ids(messages[: index + 1], False)
        if full[: len(end)] != end or end[: len(start)] != start:
            raise ValueError(f"the chat template does not render turn {index} as a stable prefix")
        for position in range(len(start), len(end)):
            targets[position] = True
    return Demonstration(full, targets)


def copy_drills(tokenizer, words: list[str], n: int, seed: int) -> list[Demonstration]:
    """``n`` copy drills: a few filler words, ``say:`` and a random text of 4-24 ``words``, then the same
    text again as the target (every token of the second copy but its first is predictable only by
    looking back at the first copy)."""
    if not words:
        raise ValueError("copy drills need a non-empty word list")
    rng = random.Random(seed)
    drills = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 24)))
        filler = " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
        first = tokenizer.encode(f"{filler}\nsay: {text}\n", add_special_tokens=False)
        second = tokenizer.encode(f"{text}\n", add_special_tokens=False)
        drills.append(Demonstration(first + second, [False] * len(first) + [True] * len(second)))
    return drills


def drill_words(texts: list[str], extra: int = 0, seed: int = 0) -> list[str]:
    """The vocabulary of copy drills: every whitespace-separated word of ``texts`` (trailing
    punctuation stripped) plus ``extra`` words of the tokenizer's training corpus."""
    from engines.model.corpus import generate_corpus

    words = {w.rstrip(".,:;") for text in texts for w in text.split()}
    if extra:
        corpus = {w for doc in generate_corpus()[:400] for w in doc.split() if w.isascii() and len(w) < 16}
        words |= set(random.Random(seed).sample(sorted(corpus), min(extra, len(corpus))))
    return sorted(w for w in words if w)


def pack_prefix_tree(demos: list[Demonstration], max_len: int) -> tuple[PackedSequence, np.ndarray]:
    """The demonstrations merged into one prefix tree (a trie over their tokens); returns it and, per
    token, how many demonstrations have that token as a target."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    counts: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for demo in demos:
        parent = -1
        for depth, (token, is_target) in enumerate(zip(demo.token_ids[:max_len], demo.targets, strict=False)):
            index = child.get((parent, token))
            if index is None:
                index = child[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                depths.append(depth)
                counts.append(0)
            counts[index] += bool(is_target) and parent >= 0
            parent = index
    n = len(tokens)
    # relabel in depth-first preorder: every subtree contiguous, as the tree kernel expects
    kids: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for index, parent in enumerate(parents):
        (kids[parent] if parent >= 0 else roots).append(index)
    order: list[int] = []
    stack = roots[::-1]
    while stack:
        index = stack.pop()
        order.append(index)
        stack.extend(kids[index][::-1])
    new_index = np.empty(n, dtype=np.int64)
    new_index[order] = np.arange(n)
    tokens = [tokens[i] for i in order]
    depths = [depths[i] for i in order]
    counts = [counts[i] for i in order]
    parents = [int(new_index[parents[i]]) if parents[i] >= 0 else -1 for i in order]
    weights = np.asarray(counts, dtype=np.float32)
    zeros = np.zeros(n, dtype=np.float32)
    tree = PackedSequence(
        token_ids=np.asarray(tokens, dtype=np.int32),
        position_ids=np.asarray(depths, dtype=np.int32),
        parent_index=np.asarray(parents, dtype=np.int32),
        loss_mask=weights > 0,
        weights=weights,
        behaviour_logprobs=zeros,
        advantages=zeros,
        policy_versions=np.full(n, -1, dtype=np.int32),
        execution_index=np.zeros(n, dtype=np.int32),
        executions=["sft"],
        leaves=[],
    )
    return tree, weights


def train_sft(
    model_dir: str,
    conversations: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]],
    out_dir: str,
    config: SFTConfig | None = None,
    log=print,
    copy_texts: list[str] | None = None,
) -> dict[str, Any]:
    """Fine-tunes the HF model at ``model_dir`` on ``conversations`` ((messages, tools) pairs) and saves
    the result (weights + tokenizer) to ``out_dir``. With ``config.copy_steps``, copy drills built from
    the words of ``copy_texts`` (and the tokenizer corpus) come first. Returns loss figures."""
    config = config or SFTConfig()
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype=torch.float32)
    if model.config._attn_implementation not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")
    model.train()
    demos = [render(tokenizer, messages, tools) for messages, tools in conversations]
    if not demos:
        raise ValueError("no demonstrations to train on")
    report: dict[str, Any] = {}
    if config.copy_steps:
        words = drill_words(copy_texts or [], extra=config.copy_corpus_words, seed=config.seed)
        drills = copy_drills(tokenizer, words, config.copy_steps * config.copy_batch_size, config.seed)
        started = time.perf_counter()
        losses = _train(
            model, drills, config.copy_steps, config.copy_batch_size, config.copy_lr, config, log, "copy"
        )
        report["copy"] = {
            "held_out_confident": _confident_share(model, copy_drills(tokenizer, words, 64, config.seed + 1)),
            "steps": config.copy_steps,
            "drills": len(drills),
            "words": len(words),
            "first_loss": losses[0],
            "final_loss": _tail_mean(losses),
            "train_s": time.perf_counter() - started,
        }
    truncated = sum(len(d.token_ids) > config.max_len for d in demos)
    started = time.perf_counter()
    losses = _train(model, demos, config.steps, config.batch_size, config.lr, config, log, "sft")
    train_s = time.perf_counter() - started
    model.eval()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "demonstrations": len(demos),
        "truncated": truncated,
        "target_tokens": sum(sum(d.targets) for d in demos),
        "steps": config.steps,
        "first_loss": losses[0],
        "final_loss": _tail_mean(losses),
        "train_s": train_s,
        "out": out_dir,
        **report,
    }


@torch.no_grad()
def _confident_share(model, drills: list[Demonstration]) -> float:
    """Share of the drills' target tokens the model gives probability > 0.5 (so they are also its
    greedy choice): how well it copies, on drills it was not trained on."""
    model.eval()
    tree, _ = pack_prefix_tree(drills, 4096)
    share = float((target_logprobs(model, tree).logprobs > math.log(0.5)).float().mean())
    model.train()
    return share


def _tail_mean(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def _train(
    model,
    demos: list[Demonstration],
    steps: int,
    batch_size: int,
    lr: float,
    config: SFTConfig,
    log,
    label: str,
) -> list[float]:
    """``steps`` AdamW steps over ``demos`` (shuffled epochs), each batch one prefix tree; linear
    warm-up then cosine to 10% of ``lr``. Returns the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay)

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return lr * (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, steps - config.warmup_steps)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    rng = random.Random(config.seed)
    order: list[int] = []
    losses: list[float] = []
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(demos)), len(demos))
        batch = [demos[order.pop()] for _ in range(batch_size)]
        tree, weights = pack_prefix_tree(batch, config.max_len)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        out = target_logprobs(model, tree)
        picked = torch.as_tensor(weights[out.targets.numpy()])
        loss = -(picked * out.logprobs).sum() / picked.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if log and (step % config.log_every == 0 or step == steps - 1):
            log(f"{label} step {step:4d}  loss {losses[-1]:.4f}  lr {lr_at(step):.2e}")
    return losses
