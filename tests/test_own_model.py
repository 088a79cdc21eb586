"""Your own model: a tiny random model of each family (Qwen2, Qwen3, Llama, Mistral) built locally, its
folder checked, a tool-using conversation rendered with its own chat template and parsed back in its
own tool-call format, then served by a real engine behind the real gateway (two calls of two
executions, the second call reusing the first call's ids) and trained for one update on what the
gateway recorded. And the folders gyre refuses, each with an error that says why."""

from __future__ import annotations

import contextlib
import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch

from engines.model.policy import PolicyError, inspect_policy
from tests.test_gateway_fixtures import ADMIN_TOKEN, ENGINE_TOKEN, Stack, serving

FORMATS = {
    "qwen2": "qwen2.5-xml-json",
    "qwen3": "qwen2.5-xml-json",
    "llama": "llama3-json",
    "mistral": "mistral",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "List the files."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call1", "type": "function", "function": {"name": "run", "arguments": '{"command": "ls"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call1", "content": "a.txt"},
]
# what each family's model writes to call run(command="ls"), as text
GENERATED_CALL = {
    "qwen2": '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call>',
    "qwen3": '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call>',
    "llama": '<|python_tag|>{"name": "run", "parameters": {"command": "ls"}}',
    "mistral": '[TOOL_CALLS][{"name": "run", "arguments": {"command": "ls"}}]',
}
# how each family's template writes that call in the conversation
RENDERED_CALL = {
    "qwen2": '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>',
    "qwen3": '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>',
    "llama": '{"name": "run", "parameters": {"command": "ls"}}<|eot_id|>',
    "mistral": '[TOOL_CALLS][{"name": "run", "arguments": {"command": "ls"}}]</s>',
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    from engines.model import ModelConfig, init_model

    root = tmp_path_factory.mktemp("families")
    for family in FORMATS:
        init_model(ModelConfig(preset="tiny", family=family, seed=1), str(root / family))
    return {family: str(root / family) for family in FORMATS}


@contextlib.contextmanager
def family_stack(folder: str, data_root: str):
    """One real engine (in-process, uvicorn) over the folder's model and the gateway over its tokenizer."""
    from engines.gateway import EngineSpec, Gateway, GatewayConfig
    from engines.gateway.app import create_app
    from engines.net import free_port
    from engines.rollout import EngineConfig, RolloutEngine
    from engines.rollout.server import create_app as engine_app
    from trajectory_store.storage import StoreConfig

    store = StoreConfig(data_root=data_root, campaign="own")
    engine = RolloutEngine(folder, EngineConfig(engine_id="A", max_model_len=2048, dtype="float32"))
    with serving(engine_app(engine, admin_token=ENGINE_TOKEN, model_name="own")) as (engine_url, server):
        port = free_port()
        config = GatewayConfig(
            model=folder,
            port=port,
            admin_token=ADMIN_TOKEN,
            engines=[EngineSpec(url=engine_url)],
            engine_admin_token=ENGINE_TOKEN,
            store=store,
        )
        gateway = Gateway(config)
        with serving(create_app(gateway), port=port) as (url, _):
            yield Stack({"A": engine}, {"A": engine_url}, {"A": server}, gateway, url, store)


@pytest.mark.parametrize("family", list(FORMATS))
def test_a_model_of_each_family_renders_parses_serves_and_trains(family, folders, tmp_path, one_thread):
    from engines.gateway.codec import ChatCodec
    from engines.model.loading import load_tokenizer
    from engines.model.weights import load_model
    from engines.train.reference import compare
    from engines.train.run import TrainStepRequest, train_step
    from trajectory_store.config import PackingConfig, SelectionConfig
    from trajectory_store.db import connect
    from trajectory_store.processor import batch_to_table, pack
    from trajectory_store.storage import Store

    folder = folders[family]
    info = inspect_policy(folder)
    assert (info.model_type, info.tool_call_format) == (family, FORMATS[family])

    # rendering: the family's own template, natively or through transformers, to the character
    codec = ChatCodec.from_folder(folder)
    assert codec.tool_call_format == FORMATS[family]
    text = codec.render(CONVERSATION, TOOLS, generation=True)
    tokenizer = load_tokenizer(folder)
    assert text == tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert RENDERED_CALL[family] in text and "a.txt" in text and '"name": "run"' in text

    # parsing: what the model would generate, as ids through the gateway's decode, back to a call
    output_ids = [*codec.encode("Let me look. " + GENERATED_CALL[family]), codec.eos_id]
    content, calls = codec.parse_text(codec.decode(output_ids), tools_on=True)
    assert calls == [{"name": "run", "arguments": {"command": "ls"}}]
    assert content == "Let me look."

    # serving: two executions of two calls each; the second call's prompt starts with the first
    # call's prompt and output ids, exactly as they were sent and generated
    with family_stack(folder, str(tmp_path / "data")) as stack:
        for k, reward in enumerate((1.0, 0.0)):
            execution = f"{family}-e{k}"
            registration = stack.register(execution, problem_id="p", group_id="g", step=0)
            client = stack.client(registration)
            messages = CONVERSATION[:2]
            first = client.chat.completions.create(
                model="own", messages=messages, tools=TOOLS, max_tokens=6, temperature=1.0, seed=k
            )
            reply = first.choices[0].message.model_dump(exclude_none=True)
            if reply.get("tool_calls"):
                results = [
                    {"role": "tool", "tool_call_id": c["id"], "content": "done"} for c in reply["tool_calls"]
                ]
            else:
                results = [{"role": "user", "content": "Go on."}]
            client.chat.completions.create(
                model="own", messages=[*messages, reply, *results], tools=TOOLS, max_tokens=6, seed=k
            )
            stack.finish(execution, reward=reward)
            (row1, sequence1), (row2, sequence2) = stack.calls(execution)
            assert sequence2[: len(sequence1)] == sequence1
            assert row2["parent_call_id"] == row1["call_id"] and row2["prefix_len"] >= len(sequence1)

    # training: the recorded calls, packed, make one optimizer update of the family's model
    store = Store(stack.store_config)
    batch = pack(connect(store, SelectionConfig()), PackingConfig(token_budget=4096, advantage="grpo"))
    assert len(batch.advantages) == 2 and any(batch.advantages)
    # the tree-packed forward honours the tree in this architecture too: per-path training's logprobs
    # and gradient (DESIGN.md 5)
    agreement = compare(load_model(folder, dtype="float32"), batch.sequences, 2)
    assert agreement.targets > 0
    assert agreement.max_abs_logprob_diff < 1e-5 and agreement.grad_rel_diff < 1e-5
    batch_uri = str(tmp_path / "batch.parquet")
    pq.write_table(batch_to_table(batch, 0), batch_uri)
    (tmp_path / "fast").mkdir()
    report = train_step(
        TrainStepRequest(
            step=0,
            init_model=folder,
            batch_uri=batch_uri,
            n_executions=2,
            checkpoint_url=str(tmp_path / "checkpoint"),
            policy_root=str(tmp_path / "store"),
            fast_dir=str(tmp_path / "fast"),
        )
    )
    assert report.trained and report.version == 1 and report.metrics["tokens_trained"] > 0
    before = load_model(folder, dtype="float32").state_dict()
    published = str(tmp_path / "store" / "policy" / "v1")
    after = load_model(published, dtype="float32").state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert inspect_policy(published).tool_call_format == FORMATS[family]  # the version serves on its own


def _broken(folders, tmp_path, family: str = "llama"):
    folder = tmp_path / "broken"
    shutil.copytree(folders[family], folder)
    return folder


def _edit(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda f: (f / "config.json").unlink(), "no config.json"),
        (lambda f: _edit(f / "config.json", model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (lambda f: (f / "tokenizer.json").unlink(), "no tokenizer"),
        (lambda f: _edit(f / "tokenizer_config.json", chat_template=None), "no chat template"),
        (lambda f: (f / "model.safetensors").unlink(), "no *.safetensors weights"),
        (
            lambda f: _edit(f / "tokenizer_config.json", gyre_tool_call_format="xml"),
            "gyre_tool_call_format is 'xml'",
        ),
        (
            lambda f: _edit(
                f / "tokenizer_config.json",
                gyre_tool_call_format=None,
                chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
            ),
            "cannot tell how this model writes tool calls",
        ),
    ],
)
def test_a_folder_gyre_cannot_use_is_refused_with_what_is_wrong(folders, tmp_path, breakage, message):
    folder = _broken(folders, tmp_path)
    breakage(folder)
    with pytest.raises(PolicyError, match=r"policy .*broken: ") as error:
        inspect_policy(folder)
    assert message in str(error.value)


def test_the_format_is_inferred_from_the_template_then_the_model_type_and_can_be_set(folders, tmp_path):
    from cli.main import main

    folder = _broken(folders, tmp_path, "mistral")
    _edit(folder / "tokenizer_config.json", gyre_tool_call_format=None)
    info = inspect_policy(folder)  # the template writes [TOOL_CALLS]
    assert (info.tool_call_format, info.format_source) == ("mistral", "the chat template ([TOOL_CALLS])")
    llama = _broken(folders, tmp_path / "l", "llama")
    _edit(llama / "tokenizer_config.json", gyre_tool_call_format=None)
    info = inspect_policy(llama)  # the template reads tools but has no marker: model_type decides
    assert (info.tool_call_format, info.format_source) == ("llama3-json", "config.json model_type 'llama'")

    _edit(llama / "tokenizer_config.json", chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(PolicyError, match="--tool-call-format FORMAT"):
        inspect_policy(llama)
    assert main(["model", "check", str(llama), "--tool-call-format", "qwen2.5-xml-json"]) == 0
    assert inspect_policy(llama).format_source == "tokenizer_config.json gyre_tool_call_format"


def test_gyre_run_refuses_a_bad_policy_before_starting_anything(tmp_path, capsys):
    from cli.main import main

    (tmp_path / "empty").mkdir()
    code = main(["run", "--policy", str(tmp_path / "empty"), "--data-root", str(tmp_path / "data")])
    assert code == 1  # as `gyre run --check` says: the campaign's check found an error
    assert f"policy {tmp_path / 'empty'}: no config.json" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # nothing was started


@pytest.mark.parametrize(
    ("tool_call_format", "text", "content", "calls"),
    [
        ("llama3-json", '{"name": "f", "parameters": {"a": 1}}', "", [{"name": "f", "arguments": {"a": 1}}]),
        (
            "llama3-json",
            'Sure.<|python_tag|>{"name": "f", "arguments": "{\\"a\\": 1}"}; {"name": "g", "parameters": {}}',
            "Sure.",
            [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}],
        ),
        ("llama3-json", "The answer is {x}.", "The answer is {x}.", []),
        ("llama3-json", '{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
        (
            "llama3-json",
            '{"name": "f", "parameters": {}} trailing',
            '{"name": "f", "parameters": {}} trailing',
            [],
        ),
        ("llama3-json", '{"name": "f", "param', '{"name": "f", "param', []),  # cut off by max_tokens
        (
            "mistral",
            'Let me see. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abc123def"}, '
            '{"name": "g", "arguments": {}}]',
            "Let me see.",
            [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}],
        ),
        ("mistral", "plain", "plain", []),
        ("mistral", '[TOOL_CALLS][{"name": "f", "argu', '[TOOL_CALLS][{"name": "f", "argu', []),
        ("mistral", '[TOOL_CALLS][{"name": 3}]', '[TOOL_CALLS][{"name": 3}]', []),
        ("qwen2.5-xml-json", '<tool_call>{"name": "f"}</tool_call>', "", [{"name": "f", "arguments": {}}]),
    ],
)
def test_each_tool_call_format_parses_its_calls_and_leaves_anything_else_as_content(
    tool_call_format, text, content, calls
):
    from engines.model.tool_calls import parse_tool_calls

    assert parse_tool_calls(text, tool_call_format) == (content, calls)
