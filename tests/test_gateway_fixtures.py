"""Shared pieces of the gateway tests (no tests here): a real tokenizer with the chat template, a tiny
Qwen2 whose weights are set by hand so that it follows a script, and loopback servers.

The scripted model (1 layer, hidden 128, untied) is a real torch model run by the real engine; its weights
make it a bigram model over scripted tokens plus one attention head that notices tools:

    residual dims: 0 = a constant 1, 1 = "a <tool_call> token is in the context", 2 = the <tool_call>
    token's own direction, 3.. = a random unit vector per token.
    attention: head 0 attends (position-insensitively, in RoPE's slowest frequency pair) to a <tool_call>
    token anywhere in the context and writes 1 into dim 1; everything else in the layer is zero.
    lm_head: each scripted successor u gets +A along its predecessor's direction and -P along the
    constant, so it wins (by ~6 * 6.5 logits) exactly after its predecessor and never elsewhere.

After the generation prompt's "\\n" it writes TEXT_SCRIPT (80 distinct tokens, then <|im_end|>) when
no tool is declared, and TOOL_CALL (<tool_call>{"arguments": {}, "name": "search"}</tool_call><|im_end|>)
when the tools header (which holds <tool_call>) is in the prompt. After any other token it samples
uniformly from the unscripted tokens and never stops before max_tokens (the stop ids are suppressed).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import random
import threading
import time

import torch
import uvicorn
from transformers import Qwen2ForCausalLM

from engines.admin import AdminClient
from engines.net import KEEP_ALIVE_S, free_port
from environments.gateway_admin import EXECUTIONS, finish_path
from tests.test_rollout_fixtures import (
    one_cpu_thread,  # noqa: F401  (re-exported for the gateway tests)
    tiny_qwen2,
)

TOOL_CALL_TEXT = '<tool_call>{"arguments":\n{},\n"name": "search"}</tool_call>'
TEXT_SCRIPT_TOKENS = 80
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


@functools.lru_cache(maxsize=1)
def tokenizer():
    from engines.model.tokenizer import build_tokenizer

    return build_tokenizer(4096)


def scripts(tok) -> tuple[list[int], list[int]]:
    """(the tool-call script, the text script), both ending with <|im_end|>."""
    vocab = tok.get_vocab()
    im_end = vocab["<|im_end|>"]
    tool = [*tok.encode(TOOL_CALL_TEXT, add_special_tokens=False), im_end]
    newline = tok.encode("\n", add_special_tokens=False)
    excluded = set(tool) | set(newline) | set(tok.get_added_vocab().values())
    pool = [i for i in range(len(tok)) if i not in excluded and "\n" not in tok.decode([i])]
    text = [*random.Random(7).sample(pool, TEXT_SCRIPT_TOKENS), im_end]
    return tool, text


def scripted_model(tok, hidden: int = 128, max_positions: int = 8192) -> Qwen2ForCausalLM:
    vocab = tok.get_vocab()
    n = len(tok)
    tool, text = scripts(tok)
    assert len(set(tool)) == len(tool) and not set(tool[:-1]) & set(text), "scripts must not share tokens"
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    newline = newline[0]
    marker = vocab["<tool_call>"]
    model = tiny_qwen2(
        n,
        max_positions,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    ).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        directions = torch.randn(n, hidden - 3, generator=generator)
        directions /= directions.norm(dim=1, keepdim=True)
        embed = torch.zeros(n, hidden)
        embed[:, 0] = 1.0
        embed[:, 3:] = directions
        embed[marker, 3:] = 0.0
        embed[marker, 2] = 1.0
        model.model.embed_tokens.weight.copy_(embed)
        head_dim = hidden // 2
        slow = head_dim // 2 - 1  # the slowest RoPE pair is (slow, slow + head_dim / 2)
        attn = layer.self_attn
        attn.q_proj.weight[slow, 0] = 2.0  # head 0 asks the same question at every position
        attn.k_proj.weight[slow, 2] = 2.0  # only the marker answers
        attn.v_proj.weight[0, 2] = 1.0
        attn.o_proj.weight[1, 0] = 1.0 / 8  # the normalized marker value is 8: the flag becomes 1

        def direction(token: int) -> torch.Tensor:
            return embed[token].clone().index_fill_(0, torch.tensor([0]), 0.0)

        strong, penalty, start_margin = 12.0, 6.0, 2.0
        head = torch.zeros(n, hidden)
        for script in (tool, text):
            for before, after in itertools.pairwise(script):
                head[after] += strong * direction(before)
        for token in {*tool, *text, newline, vocab["<|endoftext|>"], vocab["<|im_start|>"]}:
            head[token, 0] -= penalty
        head[text[0]] += strong * direction(newline)
        head[text[0], 1] -= 2 * start_margin
        head[tool[0]] += strong * direction(newline)
        head[tool[0], 1] += 2 * start_margin
        head[tool[0], 0] -= start_margin
        model.lm_head.weight.copy_(head)
    return model


@contextlib.contextmanager
def serving(app, *, port: int | None = None):
    """Runs an ASGI app with uvicorn in a thread on a loopback port; yields (url, server)."""
    if port is None:
        port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def kill(server: uvicorn.Server) -> None:
    """Stops a server as a crash would: no graceful wait for requests in flight."""
    server.force_exit = True
    server.should_exit = True


ENGINE_TOKEN = "engine-admin-token"
ADMIN_TOKEN = "gateway-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Stack:
    """Rollout engine servers + the gateway on loopback ports, and helpers to drive and read them."""

    def __init__(self, engines, engine_urls, engine_servers, gateway, url, store_config):
        self.engines = engines  # engine id -> RolloutEngine (in-process, for white-box checks)
        self.engine_urls = engine_urls
        self.engine_servers = engine_servers
        self.gateway = gateway
        self.url = url
        self.store_config = store_config

    def register(self, execution_id: str, **fields) -> dict:
        import httpx

        body = {"execution_id": execution_id, **fields}
        response = httpx.post(self.url + EXECUTIONS, headers=ADMIN, json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def client(self, registration: dict, *, agent: str | None = None, **options):
        import openai

        base = registration["base_url"]
        if agent is not None:
            base = registration["agent_base_url"].format(agent_id=agent)
        return openai.OpenAI(
            base_url=base, api_key=registration["api_key"], max_retries=0, timeout=60, **options
        )

    def typed_admin(self) -> AdminClient:
        """The typed admin client of this gateway and its engines (use it as a context manager)."""
        return AdminClient(self.url, ADMIN_TOKEN, ENGINE_TOKEN, timeout_s=60)

    def admin(self, method: str, path: str, **kwargs):
        import httpx

        return httpx.request(method, f"{self.url}{path}", headers=ADMIN, timeout=60, **kwargs)

    def finish(self, execution_id: str, status: str = "completed", reward: float = 1.0) -> dict:
        response = self.admin("POST", finish_path(execution_id), json={"status": status, "reward": reward})
        assert response.status_code == 200, response.text
        return response.json()

    def calls(self, execution_id: str) -> list[tuple[dict, list[int]]]:
        """The recorded calls of an execution: (row, prompt + output ids), in call order."""
        import pyarrow.compute as pc

        from trajectory_store.interchange import rebuild_sequences
        from trajectory_store.storage import Store

        with self.typed_admin() as admin:
            admin.flush()
        table = Store(self.store_config).read_table("calls")
        table = table.filter(pc.equal(table["execution_id"], execution_id))
        return [(row, seq.tolist()) for row, seq in rebuild_sequences(table)]

    def engine_stats(self, engine_id: str) -> dict:
        with self.typed_admin() as admin:
            return admin.engine_stats(self.engine_urls[engine_id]).model_dump()


@contextlib.contextmanager
def gateway_stack(
    data_root: str, model, engine_ids=("A", "B"), attach=None, extra_engines=(), **config_fields
):
    """Engines (one RolloutEngine each, same model) and the gateway, all uvicorn threads on loopback.
    ``attach``: the engines the gateway starts with (default all); ``extra_engines``: (id, url) of
    engines running elsewhere (a subprocess) that the gateway starts with too."""
    from engines.gateway import EngineSpec, Gateway, GatewayConfig
    from engines.gateway.app import create_app
    from engines.model.tokenizer import save_tokenizer
    from engines.rollout import EngineConfig, RolloutEngine
    from engines.rollout.server import create_app as engine_app
    from trajectory_store.storage import StoreConfig

    folder = f"{data_root}/tokenizer"
    save_tokenizer(tokenizer(), folder)
    store = StoreConfig(data_root=f"{data_root}/store", campaign="gateway-test")
    with contextlib.ExitStack() as stack:
        engines, urls, servers = {}, {}, {}
        for engine_id in engine_ids:
            engines[engine_id] = RolloutEngine(model, EngineConfig(engine_id=engine_id, max_model_len=8192))
            app = engine_app(engines[engine_id], admin_token=ENGINE_TOKEN, model_name="scripted")
            urls[engine_id], servers[engine_id] = stack.enter_context(serving(app))
        port = free_port()
        config = GatewayConfig(
            model=folder,
            port=port,
            admin_token=ADMIN_TOKEN,
            engines=[EngineSpec(url=urls[e]) for e in (engine_ids if attach is None else attach)]
            + [EngineSpec(url=url, engine_id=engine_id) for engine_id, url in extra_engines],
            engine_admin_token=ENGINE_TOKEN,
            store=store,
            **config_fields,
        )
        gateway = Gateway(config)
        url, _ = stack.enter_context(serving(create_app(gateway), port=port))
        urls.update(dict(extra_engines))
        yield Stack(engines, urls, servers, gateway, url, store)


def scripted_gateway_config(folder: str, store, engine_url: str, spool: str | None = None):
    """A gateway process's config in front of one scripted engine (tests/scripted_engine.py) that
    never flushes on its own: what it answered stays in its spool until an execution finishes."""
    from engines.gateway import EngineSpec, GatewayConfig

    return GatewayConfig(
        model=folder,
        port=free_port(),
        admin_token=ADMIN_TOKEN,
        engines=[EngineSpec(url=engine_url, engine_id="scripted")],
        engine_admin_token=ENGINE_TOKEN,
        store=store,
        spool_dir=spool,
        flush_interval_s=3600,
    )
