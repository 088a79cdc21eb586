"""RolloutEngine on a tiny random Qwen2, CPU: one behaviour per test, counters checked by name."""

from __future__ import annotations

import pytest
import torch

from engines.rollout import EngineConfig, GenerateRequest, RolloutEngine, SamplingParams
from tests.test_rollout_fixtures import VOCAB, perturbed_state, tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_policy()


def prompt(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=generator).tolist()


def req(rid, ids, session=None, **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(
        request_id=rid, session_id=session, prompt_ids=ids, sampling=SamplingParams(**sampling)
    )


def alone(model, request: GenerateRequest, **config):
    return RolloutEngine(model, EngineConfig(**config)).generate([request])[0]


def test_seed_reproducibility(model):
    sampled = dict(temperature=1.0, top_p=0.9, top_k=20, max_tokens=24)
    a = alone(model, req("a", prompt(0, 10), seed=7, **sampled))
    b = alone(model, req("b", prompt(0, 10), seed=7, **sampled))
    c = alone(model, req("c", prompt(0, 10), seed=8, **sampled))
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
    assert a.output_ids != c.output_ids
    # no seed: derived from (engine seed, request id), so the same request id reproduces
    d1 = alone(model, req("same-id", prompt(0, 10), **sampled))
    d2 = alone(model, req("same-id", prompt(0, 10), **sampled))
    assert d1.output_ids == d2.output_ids


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_equals_hf_generate_token_for_token(attn):
    model = tiny_policy(attn=attn)  # eager adds the float mask to the scores; sdpa takes it as attn_mask
    ids = prompt(1, 12)
    out = alone(model, req("g", ids, max_tokens=40))
    expected = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=40, do_sample=False, pad_token_id=0,
    )[0, len(ids) :].tolist()  # fmt: skip
    assert out.output_ids == expected
    assert len(set(expected)) > 3  # the tiny policy's greedy output is not one token repeated
    full = torch.tensor([ids + expected])
    with torch.no_grad():
        raw = torch.log_softmax(model(full).logits[0].float(), dim=-1)
    reference = [raw[len(ids) - 1 + i, t].item() for i, t in enumerate(expected)]
    torch.testing.assert_close(torch.tensor(out.output_logprobs), torch.tensor(reference), atol=1e-5, rtol=0)


def test_chunked_prefill_matches_one_shot(model):
    first_prompt = prompt(4, 45)
    outputs = []
    for chunk in (2048, 7):  # 45 tokens in 7 chunks, then a 21-token suffix in 3 more
        engine = RolloutEngine(model, EngineConfig(prefill_chunk_tokens=chunk))
        first = engine.generate([req("c1", first_prompt, "s", max_tokens=10)])[0]
        turn2 = first_prompt + first.output_ids + prompt(5, 20)
        second = engine.generate([req("c2", turn2, "s", max_tokens=10)])[0]
        outputs.append((first.output_ids, second.output_ids, second.prefilled_tokens))
    assert outputs[0] == outputs[1]


def test_logprobs_are_raw_not_temperature_scaled(model):
    ids = prompt(2, 8)
    hot = alone(model, req("hot", ids, temperature=2.0, seed=3, max_tokens=6))
    full = torch.tensor([ids + hot.output_ids])
    with torch.no_grad():
        raw = torch.log_softmax(model(full).logits[0].float(), dim=-1)
    reference = [raw[len(ids) - 1 + i, t].item() for i, t in enumerate(hot.output_ids)]
    torch.testing.assert_close(torch.tensor(hot.output_logprobs), torch.tensor(reference), atol=1e-5, rtol=0)


def test_max_tokens_and_stop_tokens(model):
    ids = prompt(3, 9)
    full = alone(model, req("full", ids, max_tokens=30))
    assert full.finish_reason == "length" and len(full.output_ids) == 30
    stop = full.output_ids[6]
    first = full.output_ids.index(stop)
    stopped = alone(model, req("stop", ids, max_tokens=30, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == full.output_ids[: first + 1]  # the stop token is part of the output
    one = alone(model, req("one", ids, max_tokens=1))
    assert one.output_ids == full.output_ids[:1] and one.finish_reason == "length"
    capped = alone(model, req("cap", ids, max_tokens=30), max_model_len=len(ids) + 5)
    assert capped.finish_reason == "length" and len(capped.output_ids) == 5


def test_batched_equals_alone_with_joins_and_leaves(model):
    requests = []
    for i in range(6):
        sampling = dict(max_tokens=8 + 5 * i, seed=100 + i)
        if i % 2:
            sampling.update(temperature=1.0, top_p=0.95)
        requests.append(req(f"r{i}", prompt(10 + i, 3 + 7 * i), **sampling))
    engine = RolloutEngine(model, EngineConfig(max_batch_size=4))
    for r in requests[:3]:
        engine.add_request(r)
    outputs, steps = {}, 0
    while engine.has_unfinished() or steps < 3:
        if steps == 3:  # later arrivals join the running batch
            for r in requests[3:]:
                engine.add_request(r)
        outputs.update({o.request_id: o for o in engine.step()})
        steps += 1
    for r in requests:
        reference = alone(model, r)
        assert outputs[r.request_id].output_ids == reference.output_ids, r.request_id
        torch.testing.assert_close(
            torch.tensor(outputs[r.request_id].output_logprobs), torch.tensor(reference.output_logprobs),
            atol=1e-5, rtol=0,
        )  # fmt: skip
    stats = engine.stats
    assert stats.max_running == 4  # capped by max_batch_size
    assert stats.decode_steps < stats.decoded_tokens - len(requests)  # one forward served several rows
    assert stats.batch_rebuilds < stats.decode_steps  # rebuilt on composition changes only


def test_multi_turn_prefills_only_the_new_suffix(model):
    engine = RolloutEngine(model, EngineConfig())
    first_prompt = prompt(20, 30)
    first = engine.generate([req("t1", first_prompt, "s", max_tokens=12)])[0]
    assert (first.cached_prompt_tokens, first.prefilled_tokens) == (0, 30)
    tool = prompt(21, 17)
    second_prompt = first_prompt + first.output_ids + tool
    second = engine.generate([req("t2", second_prompt, "s", max_tokens=12)])[0]
    # cached: the first prompt and every fed output token; the last sampled token was never fed
    assert second.cached_prompt_tokens == 30 + 12 - 1
    assert second.prefilled_tokens == 1 + len(tool)
    assert engine.stats.prefilled_tokens == 30 + 1 + len(tool)
    assert engine.stats.cached_tokens == 41 and engine.stats.recomputed_tokens == 0
    assert second.output_ids == alone(model, req("ref", second_prompt, max_tokens=12)).output_ids


def test_divergent_prompt_reuses_the_common_prefix(model):
    engine = RolloutEngine(model, EngineConfig())
    base = prompt(30, 24)
    engine.generate([req("a", base, "s", max_tokens=5)])
    branch = [*base[:15], (base[15] + 1) % VOCAB, *prompt(31, 8)]
    out = engine.generate([req("b", branch, "s", max_tokens=10)])[0]
    assert out.cached_prompt_tokens == 15 and out.prefilled_tokens == 9
    assert engine.sessions["s"].tokens == branch + out.output_ids[:-1]  # cache truncated, then extended
    assert out.output_ids == alone(model, req("ref", branch, max_tokens=10)).output_ids


def test_lru_eviction_then_exact_reprefill(model):
    budget = 100
    small, large = (RolloutEngine(model, EngineConfig(kv_budget_tokens=k)) for k in (budget, 10_000))
    contexts = {s: prompt(40 + i, 35) for i, s in enumerate("abc")}
    outputs = {}
    for s in "abc":  # a, then b, then c: a is least recently used when c needs room (3 x 40 > 100)
        for engine in (small, large):
            outputs[s] = engine.generate([req(f"{s}1", contexts[s], s, max_tokens=6)])[0].output_ids
    assert small.stats.evictions == 1 and large.stats.evictions == 0
    assert small.sessions["a"].kv_len == 0 and small.sessions["b"].kv_len == 40
    assert small.kv_tokens <= budget
    turn2 = contexts["a"] + outputs["a"] + prompt(50, 10)
    evicted = small.generate([req("a2", turn2, "a", max_tokens=15)])[0]
    kept = large.generate([req("a2", turn2, "a", max_tokens=15)])[0]
    assert evicted.output_ids == kept.output_ids
    assert evicted.cached_prompt_tokens == 0 and evicted.prefilled_tokens == len(turn2)
    assert small.stats.recomputed_tokens == 35 + 6 - 1  # the evicted session's whole cached context
    assert kept.prefilled_tokens == 1 + 10


def test_hot_swap_mid_generation_keeps_the_session(model):
    ids = prompt(60, 16)
    engine = RolloutEngine(model, EngineConfig())
    engine.add_request(req("h", ids, "s", max_tokens=20, temperature=1.0, seed=5))
    for _ in range(6):
        assert engine.step() == []
    kv_before = engine.sessions["s"].kv_len
    engine.update_weights(perturbed_state(model, seed=1), version=1)
    assert engine.sessions["s"].kv_len == kv_before  # KV kept: computed by version 0
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    swapped = outputs[0]
    assert swapped.policy_versions == [0] * 7 + [1] * 13 and swapped.policy_version == 0
    unswapped = alone(tiny_policy(), req("h", ids, max_tokens=20, temperature=1.0, seed=5))
    assert swapped.output_ids[:7] == unswapped.output_ids[:7]
    assert swapped.output_ids != unswapped.output_ids
    assert engine.stats.recomputed_tokens == 0 and engine.stats.prefilled_tokens == 16
    # the session continues under the new weights, prefix cache intact
    follow = engine.generate([req("h2", ids + swapped.output_ids, "s", max_tokens=3)])[0]
    assert follow.prefilled_tokens == 1 and follow.policy_versions == [1, 1, 1]


def test_hot_swap_with_drop_kv_recomputes_contexts(model):
    new_weights = perturbed_state(model, seed=2)
    engine = RolloutEngine(tiny_policy(), EngineConfig())
    ids = prompt(61, 16)
    engine.add_request(req("d", ids, "s", max_tokens=10))
    for _ in range(4):
        engine.step()  # each step decodes once (the first also prefills): 5 tokens out, 4 fed
    engine.update_weights(new_weights, version=3, drop_kv=True)
    assert engine.kv_tokens == 0
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    out = outputs[0]
    assert engine.stats.recomputed_tokens == out.prefilled_tokens - 16 == 16 + 4
    assert out.policy_versions == [0] * 5 + [3] * 5


def test_sleep_frees_memory_and_wake_reprefills(model, tmp_path):
    ids = prompt(70, 25)
    awake = RolloutEngine(model, EngineConfig())
    first = awake.generate([req("w1", ids, "s", max_tokens=8)])[0]
    turn2 = ids + first.output_ids + prompt(71, 6)
    reference = awake.generate([req("w2", turn2, "s", max_tokens=8)])[0]

    model.save_pretrained(tmp_path / "hf")
    engine = RolloutEngine(str(tmp_path / "hf"), EngineConfig())  # an HF folder works as well as a model
    assert engine.generate([req("w1", ids, "s", max_tokens=8)])[0].output_ids == first.output_ids
    engine.sleep()
    assert engine.asleep and engine.kv_tokens == 0
    assert sum(p.numel() for p in engine.runner.model.parameters()) == 0
    assert engine.sessions["s"].tokens == ids + first.output_ids[:-1]  # history kept
    engine.add_request(req("w2", turn2, "s", max_tokens=8))
    assert engine.step() == [] and engine.stats.decoded_tokens == 8  # queued while asleep
    engine.wake(tmp_path / "hf", version=4)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[0].output_ids == reference.output_ids
    assert outputs[0].prefilled_tokens == len(turn2)
    assert engine.stats.recomputed_tokens == len(ids) + 8 - 1
    assert outputs[0].policy_versions == [4] * 8


def test_abort_ends_a_running_request(model):
    engine = RolloutEngine(model, EngineConfig())
    engine.add_request(req("x", prompt(80, 10), "s", max_tokens=50))
    engine.add_request(req("y", prompt(81, 10), max_tokens=50))
    for _ in range(3):
        engine.step()
    engine.abort("x")
    ended = engine.step()
    assert [(o.request_id, o.finish_reason, len(o.output_ids)) for o in ended] == [("x", "abort", 4)]
    assert [s.request_id for s in engine.running] == ["y"]
    assert engine.sessions["s"].request_id is None and engine.sessions["s"].kv_len == 10 + 3


def test_refuses_what_it_cannot_serve(model):
    engine = RolloutEngine(model, EngineConfig(max_model_len=16))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(req("long", prompt(90, 16)))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(req("oov", [VOCAB]))
    engine.add_request(req("dup", [1, 2]))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(req("dup", [1, 2]))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "held", "chunk"), [(4, 2, 0, 9), (4, 2, 37, 9), (4, 1, 300, 64), (2, 2, 5, 1)]
)
def test_prefill_attention_equals_the_masked_softmax(heads, kv_heads, held, chunk):
    """The flash prefill (held tokens, then the chunk causally, merged by log-sum-exp) against the
    dense masked softmax in float64: equal up to rounding, with grouped-query heads."""
    from engines.rollout.attention import prefill_attention

    generator = torch.Generator().manual_seed(held + chunk)
    q = torch.randn(1, heads, chunk, 16, dtype=torch.float64, generator=generator)
    k = torch.randn(1, kv_heads, held + chunk, 16, dtype=torch.float64, generator=generator)
    v = torch.randn(1, kv_heads, held + chunk, 16, dtype=torch.float64, generator=generator)
    got = prefill_attention(q, k, v, 0.25)
    group = heads // kv_heads
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * 0.25
    allowed = torch.arange(held + chunk)[None, :] <= (held + torch.arange(chunk))[:, None]
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(group, 1)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_flash_prefill_matches_the_masked_prefill(model):
    """A two-turn session prefilled in chunks over held tokens: the same tokens and logprobs (1e-5)
    with the engine's flash prefill as with the [chunk, context] mask, and the model's own attention
    is back after each prefill."""
    runs = []
    for flash in (True, False):
        engine = RolloutEngine(model, EngineConfig(prefill_chunk_tokens=16, flash_prefill=flash))
        assert engine.runner.flash_prefill is flash
        first = engine.generate([req("f1", prompt(6, 70), "s", max_tokens=12)])[0]
        turn2 = prompt(6, 70) + first.output_ids + prompt(7, 40)
        second = engine.generate([req("f2", turn2, "s", max_tokens=12)])[0]
        # the first turn's last token (sampled, never fed) and the 40 new ones: the rest is held
        assert second.prefilled_tokens == 41 and model.config._attn_implementation == "sdpa"
        runs.append((first, second))
    for flash_out, masked_out in zip(*runs, strict=True):
        assert flash_out.output_ids == masked_out.output_ids
        torch.testing.assert_close(
            torch.tensor(flash_out.output_logprobs),
            torch.tensor(masked_out.output_logprobs),
            atol=1e-5,
            rtol=0,
        )
