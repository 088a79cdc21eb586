"""The supervised warm start: demonstrations from reference solutions, assistant-only targets, the
prefix-tree batch equal to one-by-one training, and a short real training run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import Qwen2ForCausalLM

from engines.model.tokenizer import save_tokenizer
from engines.train.sft import (
    Demonstration,
    SFTConfig,
    copy_drills,
    drill_words,
    pack_prefix_tree,
    render,
    train_sft,
)
from engines.train.tree import target_logprobs
from environments.demos import can_recover, demonstration, demonstrations, gives_up
from environments.harness import TOOLS
from environments.problems import generate
from tests.test_gateway_fixtures import tokenizer
from tests.train_fixtures import tiny_model


def test_demonstrations_play_the_reference_solution_through_the_harness_tools():
    for suite in ("repo", "swe", "terminal"):
        problem = generate(suite, 1, seed=3, difficulty=2)[0]
        messages = demonstration(problem)
        assert [m["role"] for m in messages[:2]] == ["system", "user"]
        assert messages[1]["content"] == problem.instruction
        calls = [m["tool_calls"][0]["function"]["name"] for m in messages if m["role"] == "assistant"]
        assert calls == [a["tool"] for a in problem.solution]
        assert calls[-1] == "finish" and calls.count("finish") == 1  # the harness stops at finish
        results = [m["content"] for m in messages if m["role"] == "tool"]
        assert not any(r.startswith("error") for r in results), results
        if problem.visible_test_command:  # the visible tests pass after the reference edits
            assert "exit code 0" in results[calls.index("run_tests")]


def test_only_assistant_turns_are_targets():
    tok = tokenizer()
    messages = demonstration(generate("terminal", 1, seed=1)[0])
    demo = render(tok, messages, TOOLS)
    text = tok.decode([t for t, target in zip(demo.token_ids, demo.targets, strict=True) if target])
    assert text.count("<tool_call>") == sum(m["role"] == "assistant" for m in messages)
    assert '"name": "finish"' in text and "<|im_end|>" in text
    assert "You are a coding agent" not in text and "<tool_response>" not in text
    assert messages[1]["content"] not in text


def test_a_recovery_demonstration_fails_first_retries_and_trains_only_on_the_retry():
    tok = tokenizer()
    problem = generate("swe", 1, seed=3)[0]
    assert can_recover(problem) and not can_recover(generate("terminal", 1, seed=1)[0])  # no visible tests
    plain, messages = demonstration(problem), demonstration(problem, recover=True)
    calls = [m["tool_calls"][0]["function"]["name"] for m in messages if m["role"] == "assistant"]
    assert calls == ["read_file", "write_file", "run_tests", "read_file", "write_file", "run_tests", "finish"]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert "\nFAIL " in results[2] and "\nFAIL " not in results[5] and "exit code 0" in results[5]
    mistake = [m for m in messages if m.get("train") is False]
    assert (
        len(mistake) == 1
        and json.loads(mistake[0]["tool_calls"][0]["function"]["arguments"])["content"]
        == (problem.files[problem.solution[1]["arguments"]["path"]])
    )
    demo = render(tok, messages, TOOLS)
    text = tok.decode([t for t, target in zip(demo.token_ids, demo.targets, strict=True) if target])
    assert text.count("<tool_call>") == 6  # every turn but the mistake
    fix = problem.solution[1]["arguments"]["content"]
    shipped = problem.files[problem.solution[1]["arguments"]["path"]]
    assert text.count('"name": "write_file"') == 1 and json.dumps(fix)[1:-1] in text
    assert json.dumps(shipped)[1:-1] not in text  # the mistake is never a target
    assert json.dumps(shipped)[1:-1] in tok.decode(demo.token_ids)  # but it is in the context
    # the same problem demonstrated plainly targets the same fix, finish and all
    plain_demo = render(tok, plain, TOOLS)
    plain_text = tok.decode([t for t, g in zip(plain_demo.token_ids, plain_demo.targets, strict=True) if g])
    assert plain_text.count("<tool_call>") == 4
    mixed = demonstrations(generate("swe", 8, seed=4) + generate("terminal", 4, seed=4), recovery_share=0.5)
    recovered = [any(m.get("train") is False for m in messages) for messages, _ in mixed]
    assert 0 < sum(recovered[:8]) < 8 and not any(recovered[8:])


def test_a_give_up_demonstration_finishes_at_once_and_the_share_is_drawn_per_problem():
    tok = tokenizer()
    problem = generate("terminal", 1, seed=2)[0]
    messages = demonstration(problem, give_up=True)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"] and gives_up(messages)
    assert messages[2]["tool_calls"][0]["function"] == {
        "name": "finish",
        "arguments": json.dumps(problem.solution[-1]["arguments"]),  # the reference's own summary
    }
    assert not gives_up(demonstration(problem))
    demo = render(tok, messages, TOOLS)
    text = tok.decode([t for t, target in zip(demo.token_ids, demo.targets, strict=True) if target])
    assert text.count("<tool_call>") == 1 and '"name": "finish"' in text  # the give-up is a target
    problems = generate("swe", 20, seed=5) + generate("terminal", 20, seed=5)
    mixed = demonstrations(problems, recovery_share=0.5, give_up_share=0.5, seed=1)
    recovered = [any(m.get("train") is False for m in messages) for messages, _ in mixed]
    given_up = [gives_up(messages) for messages, _ in mixed]
    assert not any(r and g for r, g in zip(recovered, given_up, strict=True))
    assert 0 < sum(given_up[20:]) < 20 and 0 < sum(recovered[:20]) < 20
    # the recoveries drawn do not depend on the give-up share (a recovery warm start is reproducible)
    alone = demonstrations(problems, recovery_share=0.5, seed=1)
    assert recovered == [any(m.get("train") is False for m in messages) for messages, _ in alone]
    with pytest.raises(ValueError, match=r"give_up_share 1\.5"):
        demonstrations(problems, give_up_share=1.5)
    with pytest.raises(ValueError, match="either recovers or gives up"):
        demonstration(generate("swe", 1, seed=3)[0], recover=True, give_up=True)


def test_copy_drills_target_only_the_second_copy_of_a_text():
    tok = tokenizer()
    instructions = ["Delete the file backup/todo.txt.", "Rename a.md to b/c.md."]
    assert drill_words(instructions) == sorted(
        ["Delete", "the", "file", "backup/todo.txt", "Rename", "a.md", "to", "b/c.md"]
    )
    words = drill_words(instructions, extra=50)
    assert {"backup/todo.txt", "Delete", "a.md", "b/c.md"} <= set(words) and len(words) > 50
    drills = copy_drills(tok, words, 30, seed=1)
    assert len(drills) == 30 and drills != copy_drills(tok, words, 30, seed=2)
    for drill in drills:
        start = drill.targets.index(True)
        assert all(drill.targets[start:]) and not any(drill.targets[:start])
        prompt, copied = tok.decode(drill.token_ids[:start]), tok.decode(drill.token_ids[start:])
        assert prompt.endswith(f"say: {copied}")  # the target repeats the text after "say:"
        assert set(copied.split()) <= set(words)


def _model(vocab: int) -> Qwen2ForCausalLM:
    return tiny_model(0, vocab=vocab, max_positions=4096)


def test_a_prefix_tree_batch_gives_the_loss_of_one_by_one_training():
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 50, 40).tolist()
    demos = []
    for k in range(4):
        tail = rng.integers(0, 50, 10 + k).tolist()
        if k == 3:
            tail = demos[0].token_ids[40:45] + tail  # shares a target run with the first demonstration
        tokens = shared + tail
        targets = [False] * 40 + [True] * len(tail)
        demos.append(Demonstration(tokens, targets))
    model = _model(50)
    tree, weights = pack_prefix_tree(demos, 4096)
    assert len(tree) < sum(len(d.token_ids) for d in demos)
    out = target_logprobs(model, tree)
    w = torch.as_tensor(weights[out.targets.numpy()])
    tree_loss = -(w * out.logprobs).sum() / w.sum()
    total, count = 0.0, 0
    for demo in demos:
        ids = torch.tensor([demo.token_ids])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        picked = logprobs.gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(demo.targets[1:])
        total += float(-(picked[mask]).sum())
        count += int(mask.sum())
    torch.testing.assert_close(float(tree_loss), total / count, rtol=1e-5, atol=1e-6)


def test_training_lowers_the_loss_and_saves_a_loadable_policy(tmp_path):
    tok = tokenizer()
    folder = tmp_path / "start"
    _model(len(tok)).save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tok, folder)
    demos = demonstrations(generate("terminal", 3, seed=5))
    config = SFTConfig(steps=12, batch_size=3, lr=1e-2, warmup_steps=2, copy_steps=4, copy_batch_size=4)
    instructions = ["Delete the file backup/todo.txt."]
    report = train_sft(str(folder), demos, str(tmp_path / "out"), config, copy_texts=instructions)
    assert report["demonstrations"] == 3 and report["target_tokens"] > 0
    assert report["copy"]["steps"] == 4 and report["copy"]["drills"] == 16
    assert np.isfinite(report["copy"]["final_loss"]) and 0 <= report["copy"]["held_out_confident"] <= 1
    assert report["final_loss"] < report["first_loss"] - 1.0
    reloaded = Qwen2ForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.vocab_size == len(tok)
