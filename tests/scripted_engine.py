"""A scripted rollout engine for the harness tests (no tests here).

Why not the real engine: the harness tests must steer the model precisely (delegate now, emit a
malformed tool call once, stall until the deadline) and no tiny random model can be steered like
that. So the MODEL is replaced, and nothing else: this server speaks the engine's token-id completions
protocol over real HTTP, the real gateway renders, records and parses, and the harness talks to the
gateway with the official `openai` client. A policy is a function of the decoded prompt text.

    with scripted_stack(tmp, policy) as stack: ...   # stack.register(...) / stack.client(...)
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable

from fastapi import FastAPI

from engines.admin import ENGINE_STATS
from tests.test_gateway_fixtures import gateway_stack, serving, tokenizer

Policy = Callable[[str], str]


def tool_call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def scripted_engine_app(policy: Policy, *, delay_s: float = 0.0) -> FastAPI:
    tok = tokenizer()
    im_end = tok.get_vocab()["<|im_end|>"]
    app = FastAPI()
    lock = threading.Lock()
    calls = {"n": 0}

    @app.get("/health")
    def health() -> dict:
        return {}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "scripted", "object": "model", "max_model_len": 65536}]}

    @app.get(ENGINE_STATS.path)
    def stats() -> dict:
        return {"engine_id": "scripted", "policy_version": 0, "calls": calls["n"]}

    @app.post("/v1/completions")
    def completions(body: dict) -> dict:
        prompt = body["prompt"]
        text = tok.decode(prompt, skip_special_tokens=False)
        with lock:
            calls["n"] += 1
        if delay_s:
            time.sleep(delay_s)
        output = [*tok.encode(policy(text), add_special_tokens=False), im_end]
        output = output[: body.get("max_tokens") or 16]
        finish = "stop" if output[-1] == im_end else "length"
        return {
            "id": body.get("request_id") or f"scripted-{calls['n']}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": "scripted",
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "finish_reason": finish,
                    "stop_reason": im_end if finish == "stop" else None,
                    "token_ids": output,
                    "logprobs": {
                        "text_offset": [0] * len(output),
                        "token_logprobs": [-0.5] * len(output),
                        "tokens": [f"token_id:{t}" for t in output],
                        "top_logprobs": [None] * len(output),
                    },
                    "gyre": {
                        "request_id": body.get("request_id"),
                        "session_id": body.get("session_id"),
                        "policy_versions": [0] * len(output),
                        "engine_id": "scripted",
                        "cached_prompt_tokens": 0,
                        "prefilled_tokens": len(prompt),
                        "migrated": False,
                    },
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(output),
                "total_tokens": len(prompt) + len(output),
            },
        }

    return app


@contextlib.contextmanager
def scripted_stack(data_root: str, policy: Policy, *, delay_s: float = 0.0, **gateway_fields):
    """The real gateway in front of one scripted engine; yields the gateway tests' Stack."""
    with (
        serving(scripted_engine_app(policy, delay_s=delay_s)) as (url, _),
        gateway_stack(
            data_root, None, engine_ids=(), extra_engines=[("scripted", url)], **gateway_fields
        ) as stack,
    ):
        yield stack
