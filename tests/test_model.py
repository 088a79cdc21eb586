"""The policy model (engines/model): `gyre model init` writes a Hugging Face folder that transformers
loads offline; weights are a pure function of (preset, seed) and the tokenizer of the repo's corpus;
the tokenizer round-trips any text; the chat template renders Qwen2.5-style tools, tool calls and
tool results; parse_tool_calls inverts the call format; S3 destinations work against a real S3 API
server on loopback. Everything runs the tiny preset on CPU."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import boto3
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import engines.model
from cli.main import build_parser, main
from engines.model import (
    ModelConfig,
    count_parameters,
    init_model,
    load_model,
    load_tokenizer,
    parse_tool_calls,
)
from engines.model.config import PRESETS

REPO = Path(__file__).resolve().parents[1]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "Which files are here?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"type": "function", "function": {"name": "run_shell", "arguments": {"command": "ls"}}}
        ],
    },
    {"role": "tool", "content": "a.py\nb.py"},
]
EXPECTED_TEXT = (
    "<|im_start|>system\nYou fix bugs.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "run_shell", "description": "Run a shell command", '
    '"parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}\n'
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhich files are here?<|im_end|>\n"
    "<|im_start|>assistant\nLet me look.\n<tool_call>\n"
    '{"name": "run_shell", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\na.py\nb.py\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
ODD_STRINGS = [
    "",
    " ",
    "hello world",
    "  leading and trailing  ",
    "tabs\tand\r\nwindows\nnewlines\n\n\n",
    "unicode: café naïve 日本語 Ελληνικά 😀👩‍💻 \u200b zero-width \ufeff bom",
    'def f(x: int) -> int:\n    return {"a": [1, 2.5e-3]}["a"][0]  # comment\n',
    "$ ls -la\n-rw-r--r-- 1 user user  42 Jan  1 00:00 x.py\n",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call>",
    "<|im_start <tool_call <|endoftext",
    "\x00\x01\x7f control bytes",
    "x" * 300 + "0123456789" * 5,
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny preset, seed 0, initialized once for the module."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    result = init_model(ModelConfig(preset="tiny", seed=0), str(out))
    assert result.files == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny, local_files_only=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the folder -------------------------------------------------------------------------------------
def test_transformers_loads_the_folder_offline(tiny, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 384)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert config.rope_parameters["rope_theta"] == 10_000.0 and config.max_position_embeddings == 32768
    assert config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    assert config.vocab_size == len(tokenizer) == 4096

    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
    )
    assert tokenizer.unk_token is None and tokenizer.encode(
        "hi", add_special_tokens=True
    ) == tokenizer.encode("hi", add_special_tokens=False)
    assert model.generation_config.eos_token_id == [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    saved = json.loads((tiny / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == engines.model.CHAT_TEMPLATE
    assert saved["gyre_tool_call_format"] == "qwen2.5-xml-json"
    assert not (tiny / "chat_template.jinja").exists()  # the template lives in tokenizer_config.json


def test_tiny_has_about_three_million_parameters(tiny):
    tensors = load_file(tiny / "model.safetensors")
    assert "lm_head.weight" not in tensors  # tied: saved once
    stored = sum(t.numel() for t in tensors.values())
    assert 2_000_000 <= stored <= 4_000_000
    assert stored == count_parameters(ModelConfig(preset="tiny"))


def test_docstring_table_gives_the_real_parameter_counts():
    """The preset table in engines/model/__init__.py is computed, not guessed (meta device: no memory)."""
    table = {
        m.group(1): int(m.group(2).replace(",", ""))
        for m in re.finditer(r"^\s+(\S+)\s.*?\s([\d,]{9,})$", engines.model.__doc__, re.MULTILINE)
    }
    assert set(table) == set(PRESETS)
    for preset, parameters in table.items():
        assert count_parameters(ModelConfig(preset=preset)) == parameters, preset


def test_cli_offers_every_preset():
    for preset in PRESETS:  # flows/ may not import engines/, so the CLI lists the names itself
        assert build_parser().parse_args(["model", "init", "--out", "x", "--preset", preset]).preset == preset


def test_vocab_size_and_dtype_overrides(tmp_path):
    out = tmp_path / "override"
    result = init_model(ModelConfig(preset="tiny", vocab_size=2048, dtype="bfloat16"), str(out))
    assert (result.vocab_size, result.dtype) == (2048, "bfloat16")
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].shape == (2048, 256)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert len(AutoTokenizer.from_pretrained(out, local_files_only=True)) == 2048


# -- determinism ------------------------------------------------------------------------------------
def test_same_seed_gives_identical_files_and_another_seed_other_weights(tiny, tmp_path):
    again = tmp_path / "again"
    init_model(ModelConfig(preset="tiny", seed=0), str(again))
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert sha256(again / name) == sha256(tiny / name), name

    other = tmp_path / "other"
    init_model(ModelConfig(preset="tiny", seed=1), str(other))
    assert sha256(other / "tokenizer.json") == sha256(
        tiny / "tokenizer.json"
    )  # the tokenizer ignores the seed
    seed0, seed1 = load_file(tiny / "model.safetensors"), load_file(other / "model.safetensors")
    assert seed0.keys() == seed1.keys()
    matrices = [name for name in seed0 if name.endswith("proj.weight") or "embed" in name]
    assert all(not torch.equal(seed0[name], seed1[name]) for name in matrices)
    torch.testing.assert_close(seed0["model.norm.weight"], seed1["model.norm.weight"])  # ones either way


def test_tokenizer_training_is_deterministic_across_processes(tiny):
    """A fresh process with another hash seed and one thread trains the same tokenizer.json."""
    from engines.model.tokenizer import trained_tokenizer_json

    fresh = trained_tokenizer_json.__wrapped__(4096)
    script = (
        "import hashlib; from engines.model.tokenizer import trained_tokenizer_json as t; "
        "print(hashlib.sha256(t(4096).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert child.stdout.strip() == hashlib.sha256(fresh.encode()).hexdigest()
    assert json.loads(fresh)["model"] == json.loads((tiny / "tokenizer.json").read_text())["model"]


# -- tokenizer and chat template --------------------------------------------------------------------
@pytest.mark.parametrize("text", ODD_STRINGS)
def test_any_text_round_trips_through_the_tokenizer(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=True)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_text_comes_back_in_nfc_form(tokenizer):
    """Qwen2's NFC normalization (AutoTokenizer applies it to every qwen2 model): decomposed accents compose."""
    decomposed = "combining: e\u0301 and a\u0308"
    assert tokenizer.decode(tokenizer.encode(decomposed)) == unicodedata.normalize("NFC", decomposed)


@pytest.mark.parametrize("text", [*ODD_STRINGS, "e\u0301 a\u0308 \u212b"])
def test_every_loader_gives_the_same_ids(tiny, tokenizer, text):
    """The tokenizers library reading tokenizer.json agrees with AutoTokenizer (which rebuilds Qwen2's pipeline)."""
    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=True).ids == tokenizer.encode(text, add_special_tokens=True)


def test_special_and_tool_tokens_are_single_ids(tokenizer):
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    ids = tokenizer.encode("<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>")
    # skip_special_tokens drops the ChatML markers but keeps the tool-call tags for the parser
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_chat_template_renders_tools_calls_and_results(tokenizer):
    text = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text == EXPECTED_TEXT


def test_chat_template_ids_decode_to_the_text(tokenizer):
    ids = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.decode(ids) == EXPECTED_TEXT
    assert ids == tokenizer.encode(EXPECTED_TEXT)
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    assert ids[-len(prompt) :] == prompt and prompt[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_chat_template_variants(tokenizer):
    def render(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    # no system message: the default one, as in Qwen2.5
    assert render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    )
    # OpenAI wire format: arguments as a JSON string, content None, consecutive tool results in one turn
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "go"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
                {"id": "2", "type": "function", "function": {"name": "b", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "one"},
        {"role": "tool", "tool_call_id": "2", "content": "two"},
        {"role": "assistant", "content": "done"},
    ]
    assert render(messages).endswith(
        "<|im_start|>user\ngo<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\ndone<|im_end|>\n"
    )


def test_generated_tool_calls_parse_back(tokenizer):
    text = EXPECTED_TEXT.rsplit("<|im_start|>assistant\n", 2)[1].split("<|im_end|>")[0]
    assert parse_tool_calls(text) == ("Let me look.", [{"name": "run_shell", "arguments": {"command": "ls"}}])


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain answer", "plain answer", []),
        ("", "", []),
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x"]}}\n</tool_call>',
            "",
            [{"name": "f", "arguments": {"a": [1, "x"]}}],
        ),
        (
            'Two calls.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "{\\"k\\": 2}"}</tool_call>',
            "Two calls.",
            [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"k": 2}}],
        ),
        ('<tool_call>{"name": "f"}</tool_call>', "", [{"name": "f", "arguments": {}}]),
        # bad blocks stay in the content, exactly as written
        ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
        ('<tool_call>["f", {}]</tool_call>', '<tool_call>["f", {}]</tool_call>', []),
        (
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            [],
        ),
        (
            'a <tool_call>{bad}</tool_call> b <tool_call>{"name": "ok", "arguments": {}}</tool_call> c',
            "a <tool_call>{bad}</tool_call> b  c",
            [{"name": "ok", "arguments": {}}],
        ),
        # cut off by max_tokens: an unclosed block is content
        ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    ],
)
def test_parse_tool_calls(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)


# -- the model runs ----------------------------------------------------------------------------------
def test_forward_pass_on_chat_ids_gives_finite_logits(tiny, tokenizer):
    model = load_model(tiny)
    ids = tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits  # [1, T, vocab]
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()


def test_load_model_casts_to_the_dtype_asked_for(tiny):
    model = load_model(tiny, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training


def test_weight_files_carry_their_version_and_store_tied_weights_once(tiny, tmp_path):
    from engines.model import read_weights, save_weights

    model = load_model(tiny)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied
    path = tmp_path / "fast" / "policy-v7.safetensors"
    save_weights(state, path, 7)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    loaded, version = read_weights(path, expected_version=7)
    assert version == 7
    assert set(loaded) == set(state) - {"lm_head.weight"}
    assert all(torch.equal(loaded[name], state[name]) for name in loaded)
    with pytest.raises(ValueError, match="holds policy version 7, expected 8"):
        read_weights(path, expected_version=8)
    folder_state, folder_version = read_weights(tiny)  # an HF folder: its safetensors, no version
    assert folder_version is None and set(folder_state) == set(loaded)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        read_weights(tmp_path / "empty")


# -- the command line --------------------------------------------------------------------------------
def test_cli_init_refuses_to_overwrite_unless_forced(tmp_path, cli_env, capsys):
    from tasks.model import init_model as init_task

    assert (init_task.name, init_task.task_run_name) == ("init-model", "init {preset} model at {out}")
    out = tmp_path / "cli-model"
    assert main(["model", "init", "--preset", "tiny", "--out", str(out), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "3,019,008 parameters" in printed and "vocab 4096" in printed and str(out) in printed
    first = sha256(out / "model.safetensors")

    assert main(["model", "init", "--preset", "tiny", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert sha256(out / "model.safetensors") == first

    # --force replaces model files (a stale template would shadow the new one) and keeps others
    (out / "chat_template.jinja").write_text("stale")
    (out / "NOTES.md").write_text("mine")
    assert main(["model", "init", "--preset", "tiny", "--out", str(out), "--seed", "3", "--force"]) == 0
    assert sha256(out / "model.safetensors") == first
    assert not (out / "chat_template.jinja").exists() and (out / "NOTES.md").read_text() == "mine"

    (tmp_path / "a-file").write_text("x")
    assert main(["model", "init", "--out", str(tmp_path / "a-file")]) == 2
    assert "is a file" in capsys.readouterr().err


# -- S3 -------------------------------------------------------------------------------------------------
def test_init_to_s3_then_load_through_the_cache(s3_bucket, tiny, tmp_path, cli_env, capsys):
    endpoint, bucket = s3_bucket
    url = f"s3://{bucket}/models/tiny"
    args = ["model", "init", "--preset", "tiny", "--out", url, "--s3-endpoint-url", endpoint]
    assert main(args) == 0
    assert url in capsys.readouterr().out
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = sorted(obj["Key"] for obj in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == [f"models/tiny/{name}" for name in sorted(os.listdir(tiny))]
    assert main(args) == 2 and "not empty" in capsys.readouterr().err

    cache = tmp_path / "cache"
    model = load_model(url, s3_endpoint_url=endpoint, cache_dir=cache)
    local = load_file(tiny / "model.safetensors")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(
            tensor, local[name.replace("lm_head", "model.embed_tokens")], rtol=0, atol=0
        )
    tokenizer = load_tokenizer(url, s3_endpoint_url=endpoint, cache_dir=cache)
    assert tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    ) == (EXPECTED_TEXT)
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 2  # one entry for the model folder, one for the tokenizer files alone

    load_model(url, s3_endpoint_url=endpoint, cache_dir=cache)  # a hit: nothing new
    assert sorted(p.name for p in cache.iterdir()) == entries

    # a model rewritten in place (another seed) gets a new entry with the new weights
    assert main([*args, "--seed", "1", "--force"]) == 0
    reloaded = load_model(url, s3_endpoint_url=endpoint, cache_dir=cache)
    assert len(list(cache.iterdir())) == 3
    assert not torch.equal(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
