"""What a policy folder is: checks a local Hugging Face folder before anything serves or trains it.

Pure Python (json and the file system only), so the CLI and the gateway call it cheaply.

    info = inspect_policy("./my-llama")    # PolicyInfo(model_type, tool_call_format, format_source, ...)
    set_tool_call_format("./my-model", "llama3-json")   # writes gyre_tool_call_format

A folder is accepted when it holds config.json with a supported ``model_type`` (llama, qwen2, qwen3,
mistral), a tokenizer (tokenizer.json, or tokenizer.model), a chat template (in
tokenizer_config.json, chat_template.jinja or chat_template.json) and safetensors weights. Anything
else is a `PolicyError` (a ValueError) that names the folder and what is wrong.

The tool-call format (tool_calls.py) is found, in this order:

1. tokenizer_config.json's ``gyre_tool_call_format`` (``gyre model init`` writes it; so does
   ``gyre model check DIR --tool-call-format F``), which always wins;
2. the chat template's text: ``<tool_call>`` (Qwen/Hermes), ``<|python_tag|>`` (Llama 3.1+) or
   ``[TOOL_CALLS]`` (Mistral), when exactly one of them is there;
3. config.json's ``model_type``, when the template renders tools at all (it reads ``tools``).

Otherwise it cannot be told, and the error says what was found and how to set it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from engines.model.chat import TOOL_CALL_FORMAT as QWEN_FORMAT
from engines.model.tool_calls import FORMATS, LLAMA3_FORMAT, MISTRAL_FORMAT, MISTRAL_TOOL_CALLS, PYTHON_TAG

FORMAT_KEY = "gyre_tool_call_format"
SUPPORTED_MODEL_TYPES = {
    "llama": LLAMA3_FORMAT,
    "qwen2": QWEN_FORMAT,
    "qwen3": QWEN_FORMAT,
    "mistral": MISTRAL_FORMAT,
}
"""model_type -> the tool-call format of that family's instruct models"""
TEMPLATE_MARKERS = {"<tool_call>": QWEN_FORMAT, PYTHON_TAG: LLAMA3_FORMAT, MISTRAL_TOOL_CALLS: MISTRAL_FORMAT}
"""text in a chat template -> the tool-call format it writes"""


class PolicyError(ValueError):
    """A policy folder that gyre cannot serve or train, and why."""


@dataclass(frozen=True)
class PolicyInfo:
    folder: str
    model_type: str
    architecture: str
    """config.json's architectures[0] (e.g. LlamaForCausalLM)"""
    tool_call_format: str
    format_source: str
    """where the format came from: tokenizer_config.json, the chat template, or model_type"""
    chat_template_source: str
    """the file that holds the chat template"""


def inspect_policy(folder: str | os.PathLike) -> PolicyInfo:
    """The checked description of the policy folder ``folder`` (see the module docstring)."""
    path = Path(folder)
    if not path.is_dir():
        raise PolicyError(f"policy {folder}: no such folder")
    config = _json(path, "config.json")
    if config is None:
        raise PolicyError(f"policy {folder}: no config.json, so it is not a Hugging Face model folder")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PolicyError(
            f"policy {folder}: config.json's model_type {model_type!r} is not supported; "
            f"gyre serves and trains {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()):
        raise PolicyError(f"policy {folder}: no tokenizer (neither tokenizer.json nor tokenizer.model)")
    tokenizer_config = _json(path, "tokenizer_config.json") or {}
    template, template_source = chat_template(path, tokenizer_config)
    if not template:
        raise PolicyError(
            f"policy {folder}: no chat template (tokenizer_config.json has no chat_template, and there is "
            "no chat_template.jinja or chat_template.json); gyre renders every call with the model's own "
            "template, so a base model needs one added first"
        )
    if not any(path.glob("*.safetensors")):
        raise PolicyError(
            f"policy {folder}: no *.safetensors weights (a folder with only .bin files can be converted with "
            "transformers: from_pretrained(...).save_pretrained(..., safe_serialization=True))"
        )
    tool_call_format, source = _tool_call_format(folder, tokenizer_config, template, model_type)
    architectures = config.get("architectures") or ["?"]
    return PolicyInfo(
        folder=str(folder),
        model_type=model_type,
        architecture=str(architectures[0]),
        tool_call_format=tool_call_format,
        format_source=source,
        chat_template_source=template_source,
    )


def chat_template(path: Path, tokenizer_config: dict) -> tuple[str, str]:
    """(the folder's default chat template, the file it is in); ("", "") when there is none."""
    inline = tokenizer_config.get("chat_template")
    if isinstance(inline, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in inline if isinstance(t, dict)}
        inline = named.get("default") or next(iter(named.values()), None)
    if isinstance(inline, str) and inline:
        return inline, "tokenizer_config.json"
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), jinja.name
    stored = _json(path, "chat_template.json") or {}
    if isinstance(stored.get("chat_template"), str):
        return stored["chat_template"], "chat_template.json"
    return "", ""


def tool_call_format_of(folder: str | os.PathLike) -> tuple[str, str]:
    """(tool-call format, where it came from) of a folder holding at least the tokenizer files (what the
    gateway is given); config.json's model_type is used when it is there. PolicyError when it cannot tell."""
    path = Path(folder)
    tokenizer_config = _json(path, "tokenizer_config.json") or {}
    template, _ = chat_template(path, tokenizer_config)
    model_type = (_json(path, "config.json") or {}).get("model_type")
    return _tool_call_format(folder, tokenizer_config, template, model_type)


def set_tool_call_format(folder: str | os.PathLike, tool_call_format: str) -> None:
    """Writes ``gyre_tool_call_format`` into the folder's tokenizer_config.json (creating it if needed)."""
    if tool_call_format not in FORMATS:
        raise PolicyError(f"unknown tool-call format {tool_call_format!r}; known: {', '.join(FORMATS)}")
    path = Path(folder) / "tokenizer_config.json"
    config = _json(Path(folder), "tokenizer_config.json") or {}
    config[FORMAT_KEY] = tool_call_format
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _tool_call_format(
    folder, tokenizer_config: dict, template: str, model_type: str | None
) -> tuple[str, str]:
    declared = tokenizer_config.get(FORMAT_KEY)
    if declared is not None:
        if declared not in FORMATS:
            raise PolicyError(
                f"policy {folder}: tokenizer_config.json's {FORMAT_KEY} is {declared!r}, "
                f"which is none of {', '.join(FORMATS)}"
            )
        return declared, f"tokenizer_config.json {FORMAT_KEY}"
    found = {fmt for marker, fmt in TEMPLATE_MARKERS.items() if marker in template}
    if len(found) == 1:
        (only,) = found
        marker = next(m for m, f in TEMPLATE_MARKERS.items() if f == only)
        return only, f"the chat template ({marker})"
    if not found and "tools" in template and model_type in SUPPORTED_MODEL_TYPES:
        return SUPPORTED_MODEL_TYPES[model_type], f"config.json model_type {model_type!r}"
    seen = (
        f"the chat template writes several formats ({', '.join(sorted(found))})"
        if found
        else f"the chat template has none of {', '.join(TEMPLATE_MARKERS)} and never reads `tools`"
    )
    raise PolicyError(
        f"policy {folder}: cannot tell how this model writes tool calls: tokenizer_config.json has no "
        f"{FORMAT_KEY}, {seen}, and config.json's model_type is {model_type!r}. Set it with "
        f'`gyre model check {folder} --tool-call-format FORMAT` (it writes "{FORMAT_KEY}": FORMAT into '
        f"tokenizer_config.json), FORMAT one of {', '.join(FORMATS)}"
    )


def _json(path: Path, name: str) -> dict | None:
    file = path / name
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise PolicyError(f"policy {path}: {name} is not valid JSON ({error})") from None
    return value if isinstance(value, dict) else None
