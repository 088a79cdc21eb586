"""Token fidelity: each (execution, agent) keeps the exact token ids of what it already sent to an engine
and what the engine generated, so a request that repeats earlier messages reuses those ids instead of
re-tokenizing text. Each recorded prompt is then exactly what the engine conditioned on, and call k+1's
prompt extends call k's prompt + output token for token.

    context = SessionContext(codec, window=32)
    plan = context.plan(messages, tools)       # PromptPlan: prompt_ids, reused / new token counts
    ...send plan.prompt_ids, get output_ids...
    context.commit(plan, output_ids, assistant_message)

Checkpoints. After each call two checkpoints are kept, each a message prefix with the ids that stand for
it and the length + hash of its rendered text:

    prompt     the request's messages; ids = the prompt minus the generation prompt (it ends where the
               last turn closed, e.g. "...<|im_end|>\\n")
    assistant  the request's messages + the assistant message we returned; ids = prompt + output ids
               (+ the end-of-turn id when the output did not end with it, e.g. a 'length' finish)
               + the ids of what the template writes after the end-of-turn token ("\\n" for ChatML)

A new request is matched against checkpoints by a hash chain over its messages (tools first): an
assistant message is keyed by its tool_call ids when it has tool calls (ours are unique), else by its
stripped content; any other message by role, content, tool_call_id and name. For the longest matching
checkpoint, the request is rendered with OUR copy of the matched messages (a harness that re-serialized
tool-call arguments does not change what we splice) and accepted only if the rendered text starts with
the checkpoint's text (same length and hash) and the rest starts with an added token (so tokenizing the
rest alone gives what tokenizing the whole would, codec.py). Then prompt = checkpoint ids + encode(rest).
Otherwise the next shorter checkpoint is tried, and with none the whole conversation is tokenized.
Assistant messages in the re-tokenized part were not reused from generated ids: they are counted
(`PromptPlan.retokenized_assistant`; a harness that edited history, or an injected few-shot turn).

Storage is O(unique tokens): a checkpoint holds its parent, how many of the parent's ids it keeps and
its own new ids; `ids()` rebuilds the full list in one pass. Only the last ``window`` calls' checkpoints
are kept (older contexts sent again are re-tokenized).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from engines.gateway.codec import ChatCodec


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def message_key(message: dict) -> bytes:
    """What identifies a message when matching a request against earlier calls."""
    role = message.get("role")
    if role == "assistant":
        calls = message.get("tool_calls") or []
        if calls:
            return orjson.dumps(["assistant/calls", [c.get("id") for c in calls]])
        return orjson.dumps(["assistant", _text(message.get("content")).strip()])
    return orjson.dumps(
        [role, _text(message.get("content")), message.get("tool_call_id"), message.get("name")]
    )


def chain_keys(messages: list[dict], tools: list[dict] | None) -> tuple[list[bytes], Any]:
    """(keys, hasher): keys[i] identifies (tools, messages[:i]); one running hash with a digest per
    prefix, returned so a further message can extend it (`extend`)."""
    hasher = hashlib.blake2b(digest_size=16)
    _feed(hasher, orjson.dumps(tools or [], option=orjson.OPT_SORT_KEYS))
    keys = [hasher.digest()]
    for message in messages:
        _feed(hasher, message_key(message))
        keys.append(hasher.digest())
    return keys, hasher


def extend(hasher: Any, message: dict) -> bytes:
    """The key of the prefix ``hasher`` covers plus ``message``."""
    longer = hasher.copy()
    _feed(longer, message_key(message))
    return longer.digest()


def _feed(hasher: Any, key: bytes) -> None:
    hasher.update(len(key).to_bytes(8, "little") + key)


@dataclass(eq=False)
class Checkpoint:
    """A message prefix and the exact ids that stand for it (see the module docstring)."""

    key: bytes
    messages: list[dict]  # our copy of the prefix (what gets rendered in its place)
    text_len: int  # characters of its rendered text
    text_hash: bytes
    parent: Checkpoint | None
    parent_len: int  # ids kept from the parent
    tail: list[int]  # ids after them
    length: int = field(init=False)

    def __post_init__(self) -> None:
        self.length = self.parent_len + len(self.tail)

    def ids(self) -> list[int]:
        pieces, cut, node = [], self.length, self
        while node is not None:
            keep = cut - node.parent_len
            if keep > 0:
                pieces.append(node.tail[:keep])
            cut = min(cut, node.parent_len)
            node = node.parent
        ids: list[int] = []
        for piece in reversed(pieces):
            ids.extend(piece)
        return ids


def child(parent: Checkpoint | None, prefix: list[int], length: int, **fields: Any) -> Checkpoint:
    """A checkpoint whose ids are prefix[:length], where prefix starts with parent.ids()."""
    if parent is None:
        return Checkpoint(parent=None, parent_len=0, tail=prefix[:length], **fields)
    kept = min(parent.length, length)
    return Checkpoint(parent=parent, parent_len=kept, tail=prefix[parent.length : length], **fields)


@dataclass
class PromptPlan:
    """The prompt of one call and where its ids came from."""

    prompt_ids: list[int]
    messages: list[dict]  # what was rendered: our copies of the reused prefix, then the request's own
    tools: list[dict] | None
    keys: list[bytes]  # chain keys of the request's messages
    hasher: Any  # the running hash after all of them
    text: str | None  # the rendered prompt, when it was rendered whole
    base: Checkpoint | None  # the checkpoint reused, if any
    reused_tokens: int  # ids taken from earlier calls (exactly as sent / generated then)
    new_tokens: int  # ids tokenized from text for this call
    retokenized_assistant: int  # assistant messages in the tokenized part (history not reused)


class SessionContext:
    """The checkpoints of one (execution, agent); not thread-safe (the gateway serializes an agent's calls)."""

    def __init__(self, codec: ChatCodec, window: int = 32):
        self.codec = codec
        self.window = window
        self.checkpoints: OrderedDict[bytes, Checkpoint] = OrderedDict()
        self.calls = 0

    def plan(self, messages: list[dict], tools: list[dict] | None) -> PromptPlan:
        keys, hasher = chain_keys(messages, tools)
        checkpoint, n, merged, text, rest = self._resume(messages, tools, keys)
        base_ids = checkpoint.ids() if checkpoint is not None else []
        new_ids = self.codec.encode(rest)
        return PromptPlan(
            prompt_ids=base_ids + new_ids,
            messages=merged,
            tools=tools,
            keys=keys,
            hasher=hasher,
            text=text,
            base=checkpoint,
            reused_tokens=len(base_ids),
            new_tokens=len(new_ids),
            retokenized_assistant=sum(m.get("role") == "assistant" for m in messages[n:]),
        )

    def _resume(
        self, messages: list[dict], tools: list[dict] | None, keys: list[bytes]
    ) -> tuple[Checkpoint | None, int, list[dict], str | None, str]:
        """Where the prompt starts from: the checkpoint of the longest prefix of ``messages`` it holds
        (whose text continues at a token boundary), the number of messages it covers, the messages
        merged after it, the whole rendered text (None when the renderer continued incrementally) and
        the text left to tokenize; without such a checkpoint, (None, 0, the messages, their text, their
        text)."""
        codec, renderer = self.codec, self.codec.renderer
        for n in range(len(messages), 0, -1):
            checkpoint = self.checkpoints.get(keys[n])
            if checkpoint is None:
                continue
            merged = checkpoint.messages + messages[n:]
            text = None
            if renderer.incremental:
                rest = renderer.continuation(merged, tools, n, generation=True)
            else:
                text = renderer.render(merged, tools, generation=True)
                rest = text[checkpoint.text_len :]
                if _digest(text[: checkpoint.text_len].encode()) != checkpoint.text_hash:
                    rest = None
            if rest is not None and codec.starts_at_boundary(rest):
                return checkpoint, n, merged, text, rest
        text = renderer.render(messages, tools, generation=True)
        return None, 0, list(messages), text, text

    def commit(self, plan: PromptPlan, output_ids: list[int], assistant: dict | None) -> None:
        """Keeps the call's prompt checkpoint and, when ``assistant`` (the message returned to the
        harness) renders in a way we can splice after, its assistant checkpoint."""
        self.calls += 1
        codec, renderer = self.codec, self.codec.renderer
        prompt = plan.prompt_ids
        suffix, gen_ids = codec.generation_suffix, codec.generation_ids
        closed_len = len(prompt) - len(gen_ids)
        prompt_checkpoint = plan.base
        if prompt[closed_len:] == gen_ids:
            text_len, text_hash = 0, b""
            if not renderer.incremental:
                text = plan.text or renderer.render(plan.messages, plan.tools, generation=True)
                if not text.endswith(suffix):
                    return
                closed = text[: len(text) - len(suffix)]
                text_len, text_hash = len(closed), _digest(closed.encode())
            prompt_checkpoint = child(
                plan.base,
                prompt,
                closed_len,
                key=plan.keys[-1],
                messages=plan.messages,
                text_len=text_len,
                text_hash=text_hash,
            )
            self._keep(prompt_checkpoint)
        if assistant is None:
            return
        messages = [*plan.messages, assistant]
        if renderer.incremental:
            turn = renderer.continuation(messages, plan.tools, len(plan.messages), generation=False)
            if turn is None or not turn.startswith(suffix):
                return
            text_len, text_hash = 0, b""
        else:
            text = renderer.render(messages, plan.tools, generation=False)
            prompt_text = plan.text or renderer.render(plan.messages, plan.tools, generation=True)
            if not text.startswith(prompt_text):
                return
            turn = text[len(prompt_text) - len(suffix) :]
            text_len, text_hash = len(text), _digest(text.encode())
        end = turn.rfind(codec.eos_token)
        closing = turn[end + len(codec.eos_token) :]
        if end < len(suffix) or any(b in closing for b in codec.boundaries):
            return  # this template closes the turn in a way we cannot splice after: no checkpoint
        ids = prompt + list(output_ids)
        if not output_ids or output_ids[-1] != codec.eos_id:
            ids.append(codec.eos_id)
        ids += codec.encode(closing)
        self._keep(
            child(
                prompt_checkpoint,
                ids,
                len(ids),
                key=extend(plan.hasher, assistant),
                messages=messages,
                text_len=text_len,
                text_hash=text_hash,
            )
        )

    def _keep(self, checkpoint: Checkpoint) -> None:
        self.checkpoints[checkpoint.key] = checkpoint
        self.checkpoints.move_to_end(checkpoint.key)
        while len(self.checkpoints) > 2 * self.window:
            self.checkpoints.popitem(last=False)
