"""engines/protocol.py: the engine wire both the gateway and the engine server import. What crosses it
must survive a round trip, a vLLM-shaped answer (none of our extensions) must still parse, and
common_prefix is checked against hand-computed lengths."""

from __future__ import annotations

import math

import pytest

from engines.protocol import EngineCompletion, EngineCompletionRequest, common_prefix


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3),  # a prompt extending what is held
        ([1, 2, 3, 4], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 9], 2),  # diverges at the last position
        ([7, 2, 3], [1, 2, 3], 0),
        ([], [1, 2], 0),
        ([], [], 0),
        ([5] * 1000 + [1], [5] * 1000 + [2], 1000),
    ],
)
def test_common_prefix(a, b, expected):
    assert common_prefix(a, b) == expected


def test_a_request_round_trips_and_leaves_unset_fields_out():
    request = EngineCompletionRequest.model_construct(
        prompt=[1, 2, 3], max_tokens=4, temperature=0.0, stop_token_ids=[9], session_id="e/main"
    )
    wire = request.model_dump_json(exclude_none=True)
    assert '"seed"' not in wire and '"top_k"' not in wire  # an older vLLM may refuse null for them
    back = EngineCompletionRequest.model_validate_json(wire)
    assert (back.prompt, back.max_tokens, back.stop_token_ids, back.session_id) == (
        [1, 2, 3],
        4,
        [9],
        "e/main",
    )


def test_a_vllm_answer_without_our_extensions_parses():
    vllm = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "logprobs": {
                    "text_offset": [0, 1],
                    "token_logprobs": [-0.5, -1.25],
                    "tokens": ["token_id:5", "token_id:6"],
                    "top_logprobs": [{"token_id:5": -0.5}, {"token_id:6": -1.25}],
                },
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [5, 6],
                "prompt_logprobs": None,  # a vLLM field we do not read
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }
    completion = EngineCompletion.model_validate(vllm)
    assert completion.choice.token_ids == [5, 6] and completion.choice.gyre is None
    assert completion.choice.logprobs.token_logprobs == [-0.5, -1.25]
    assert completion.prefilled_tokens() == 10  # no cache details: the whole prompt was prefilled
    vllm["usage"]["prompt_tokens_details"] = {"cached_tokens": 8}
    assert EngineCompletion.model_validate(vllm).prefilled_tokens() == 2


def test_our_answer_keeps_the_gyre_extension_and_infinite_logprobs():
    ours = {
        "id": "r",
        "choices": [
            {
                "finish_reason": "stop",
                "token_ids": [5, 6],
                "logprobs": {"token_logprobs": [-0.5, -math.inf]},
                "gyre": {
                    "engine_id": "A",
                    "policy_versions": [3, 4],
                    "prefilled_tokens": 7,
                    "migrated": True,
                },
            }
        ],
    }
    completion = EngineCompletion.model_validate(ours)
    back = EngineCompletion.model_validate_json(completion.model_dump_json())
    assert back.choice.gyre.engine_id == "A" and back.choice.gyre.policy_versions == [3, 4]
    assert back.choice.gyre.migrated is True and back.prefilled_tokens() == 7
    assert back.choice.logprobs.token_logprobs == [-0.5, -math.inf]


def test_an_answer_without_token_ids_is_refused_by_name():
    with pytest.raises(ValueError, match="token_ids"):
        EngineCompletion.model_validate({"id": "r", "choices": [{"finish_reason": "stop"}]})
