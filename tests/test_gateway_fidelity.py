"""Token fidelity without servers: the native ChatML renderer against Jinja, and SessionContext's
reuse of exact earlier ids (engines/gateway/context.py)."""

from __future__ import annotations

import random

import pytest

from engines.gateway.codec import ChatCodec
from engines.gateway.context import Checkpoint, SessionContext, child
from engines.gateway.render import ChatMLRenderer, TemplateRenderer
from tests.test_gateway_fixtures import TOOLS, tokenizer


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(tokenizer())


@pytest.fixture(scope="module")
def jinja_codec() -> ChatCodec:
    codec = ChatCodec(tokenizer())
    codec.renderer = TemplateRenderer(codec.tokenizer)
    return codec


def random_conversation(rng: random.Random) -> list[dict]:
    words = ["alpha", " beta", "γ", "", "  spaced ", "new\nline", '{"json": 1}', "<tool_call>x</tool_call>"]
    messages: list[dict] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": rng.choice(words)})
    for i in range(rng.randint(1, 8)):
        kind = rng.choice(["user", "assistant", "calls", "tool", "tool", "system", "parts"])
        if kind == "user":
            messages.append({"role": "user", "content": rng.choice(words)})
        elif kind == "parts":
            parts = [{"type": "text", "text": rng.choice(words)}, {"type": "image_url", "image_url": {}}]
            messages.append({"role": "user", "content": parts})
        elif kind == "assistant":
            messages.append({"role": "assistant", "content": rng.choice([*words, None])})
        elif kind == "calls":
            calls = [
                {
                    "id": f"c{i}{j}",
                    "type": "function",
                    "function": {
                        "name": rng.choice(["f", "g"]),
                        "arguments": rng.choice(['{"a": 1}', {"b": [1, "é"]}]),
                    },
                }
                for j in range(rng.randint(1, 2))
            ]
            messages.append(
                {"role": "assistant", "content": rng.choice([None, "", "thinking"]), "tool_calls": calls}
            )
        elif kind == "tool":
            messages.append({"role": "tool", "tool_call_id": "c", "content": rng.choice(words)})
        else:
            messages.append({"role": "system", "content": rng.choice(words)})
    return messages


def test_native_renderer_matches_the_jinja_template_exactly(codec, jinja_codec):
    assert isinstance(codec.renderer, ChatMLRenderer)
    rng = random.Random(0)
    for _ in range(300):
        messages = random_conversation(rng)
        tools = rng.choice([None, TOOLS])
        for generation in (False, True):
            native = codec.renderer.render(messages, tools, generation=generation)
            assert native == jinja_codec.renderer.render(messages, tools, generation=generation)
        # continuation = the text after the closed prefix, whenever the renderer offers one
        for start in range(1, len(messages)):
            rest = codec.renderer.continuation(messages, tools, start, generation=True)
            if rest is None:
                assert messages[start - 1]["role"] == messages[start]["role"] == "tool"
                continue
            closed = codec.renderer.render(messages[:start], tools, generation=False)
            assert closed + rest == codec.renderer.render(messages, tools, generation=True)


def test_a_template_other_than_ours_goes_through_jinja():
    tok = tokenizer()
    saved = tok.chat_template
    tok.chat_template = saved.replace("You are a helpful assistant.", "You are terse.")
    try:
        assert isinstance(ChatCodec(tok).renderer, TemplateRenderer)
    finally:
        tok.chat_template = saved


def turn(context: SessionContext, messages: list[dict], output_ids: list[int], assistant: dict, tools=None):
    plan = context.plan(messages, tools)
    context.commit(plan, output_ids, assistant)
    return plan


@pytest.mark.parametrize("which", ["native", "jinja"])
def test_later_prompts_extend_earlier_prompt_and_output_ids_exactly(which, codec, jinja_codec):
    codec = codec if which == "native" else jinja_codec
    context = SessionContext(codec)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    # a generated answer whose ids are NOT how the tokenizer would write its text (byte by byte)
    answer = " Hello there"
    odd_ids = [i for ch in answer for i in codec.encode(ch)] + [codec.eos_id]
    assert odd_ids[:-1] != codec.encode(answer)
    first = turn(context, messages, odd_ids, {"role": "assistant", "content": answer})
    assert first.reused_tokens == 0 and first.prompt_ids == codec.encode(
        codec.render(messages, None, generation=True)
    )
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    second = turn(
        context, messages, [5, 6, codec.eos_id], {"role": "assistant", "content": codec.decode([5, 6])}
    )
    sequence = first.prompt_ids + odd_ids
    assert second.prompt_ids[: len(sequence)] == sequence
    assert second.reused_tokens == len(sequence) + 1  # + the "\n" that closes the turn
    assert second.prompt_ids[len(sequence) :] == codec.encode(
        "\n" + "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )
    assert second.retokenized_assistant == 0
    # the same request again (a retry) gives the same ids
    assert context.plan(messages, None).prompt_ids == second.prompt_ids


def test_tool_calls_are_matched_by_id_even_when_the_harness_reserializes_arguments(codec):
    context = SessionContext(codec)
    messages = [{"role": "user", "content": "find it"}]
    generated = [
        *codec.encode('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>'),
        codec.eos_id,
    ]
    ours = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
        ],
    }
    first = turn(context, messages, generated, ours, TOOLS)
    echoed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{ "q":"x" }'}}
        ],
    }
    messages += [echoed, {"role": "tool", "tool_call_id": "call_1", "content": "found"}]
    second = context.plan(messages, TOOLS)
    assert second.prompt_ids[: len(first.prompt_ids) + len(generated)] == first.prompt_ids + generated
    assert second.retokenized_assistant == 0
    # what gets rendered after the reused ids uses our copy of the assistant message, not the echo
    assert second.messages[1] is ours


def test_edited_history_falls_back_to_the_longest_exact_prefix_and_is_counted(codec):
    context = SessionContext(codec)
    messages = [{"role": "user", "content": "q1"}]
    first = turn(
        context, messages, [7, 8, codec.eos_id], {"role": "assistant", "content": codec.decode([7, 8])}
    )
    edited = [
        *messages,
        {"role": "assistant", "content": "something else"},
        {"role": "user", "content": "q2"},
    ]
    plan = context.plan(edited, None)
    assert plan.retokenized_assistant == 1
    closed = first.prompt_ids[: len(first.prompt_ids) - len(codec.generation_ids)]
    assert plan.reused_tokens == len(closed) and plan.prompt_ids[: len(closed)] == closed
    assert plan.prompt_ids == codec.encode(codec.render(edited, None, generation=True))


def test_an_output_cut_by_length_gets_its_turn_closed(codec):
    context = SessionContext(codec)
    messages = [{"role": "user", "content": "long answer please"}]
    cut = [11, 12, 13]  # no end-of-turn token: finish_reason 'length'
    first = turn(context, messages, cut, {"role": "assistant", "content": codec.decode(cut)})
    messages += [{"role": "assistant", "content": codec.decode(cut)}, {"role": "user", "content": "go on"}]
    second = context.plan(messages, None)
    head = first.prompt_ids + cut + [codec.eos_id] + codec.encode("\n")
    assert second.prompt_ids[: len(head)] == head


def test_a_second_tool_result_never_splices_through_a_closed_tool_turn(codec):
    context = SessionContext(codec)
    messages = [{"role": "user", "content": "go"}, {"role": "tool", "tool_call_id": "a", "content": "r1"}]
    turn(context, messages, [9, codec.eos_id], {"role": "assistant", "content": codec.decode([9])})
    messages = [*messages, {"role": "tool", "tool_call_id": "b", "content": "r2"}]
    plan = context.plan(messages, None)
    assert plan.prompt_ids == codec.encode(codec.render(messages, None, generation=True))


def test_checkpoint_ids_rebuild_branches_in_one_pass():
    root = Checkpoint(
        key=b"r", messages=[], text_len=0, text_hash=b"", parent=None, parent_len=0, tail=[1, 2, 3, 4]
    )
    branch = child(root, [1, 2, 3, 4, 5, 6], 6, key=b"b", messages=[], text_len=0, text_hash=b"")
    shorter = child(branch, [1, 2, 3, 4, 5], 3, key=b"s", messages=[], text_len=0, text_hash=b"")
    deeper = child(shorter, [1, 2, 3, 9, 9], 5, key=b"d", messages=[], text_len=0, text_hash=b"")
    assert branch.ids() == [1, 2, 3, 4, 5, 6]
    assert shorter.ids() == [1, 2, 3]
    assert deeper.ids() == [1, 2, 3, 9, 9]


def test_only_the_last_window_of_calls_is_kept(codec):
    context = SessionContext(codec, window=2)
    messages: list[dict] = []
    for i in range(6):
        messages = [*messages, {"role": "user", "content": f"q{i}"}]
        turn(
            context,
            messages,
            [20 + i, codec.eos_id],
            {"role": "assistant", "content": codec.decode([20 + i])},
        )
        messages = [*messages, {"role": "assistant", "content": codec.decode([20 + i])}]
    assert len(context.checkpoints) == 4
    assert context.plan([{"role": "user", "content": "q0"}], None).reused_tokens == 0  # forgotten
