"""Tool-call formats: how each model family writes a function call, and the parser of each.

Pure Python (no torch, no transformers), so the gateway imports it cheaply.

    format              family           what the model generates
    qwen2.5-xml-json    Qwen2, Qwen3,    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one block
                        Hermes           per call, after optional content
    llama3-json         Llama 3.1+       {"name": "f", "parameters": {...}}: the whole answer is the JSON call
                                         (or several, separated by ";"), optionally after <|python_tag|>
    mistral             Mistral v0.3     [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] after optional
                                         content

Every parser has the same contract as the Qwen one (`chat.parse_tool_calls`): ``parse(text) ->
(content, calls)``, each call ``{"name": str, "arguments": dict}`` (arguments given as a JSON string
holding an object are accepted too); text that is not a well-formed call stays in the content as
written and nothing raises. ``MARKERS`` are the tokens a format needs to see in decoded text: the
gateway keeps them when it decodes even where the tokenizer marks them special (Llama's
<|python_tag|> and Mistral's [TOOL_CALLS] are).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from engines.model.chat import TOOL_CALL_FORMAT as QWEN_FORMAT
from engines.model.chat import parse_tool_calls as parse_qwen
from engines.model.chat import tool_call

LLAMA3_FORMAT = "llama3-json"
MISTRAL_FORMAT = "mistral"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"

ToolCall = dict[str, Any]
Parser = Callable[[str], tuple[str, list[ToolCall]]]


def parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.1's JSON calls: ``{"name": ..., "parameters": {...}}`` ("arguments" is accepted too) as
    the whole answer, several joined by ";", optionally after ``<|python_tag|>`` (whatever precedes the
    tag is content). Anything else, or any call in the run that does not parse, is content."""
    head, tag, tail = text.partition(PYTHON_TAG)
    content, body = (head, tail) if tag else ("", text)
    calls = _json_calls(body, separator=";", arguments_keys=("parameters", "arguments"))
    if calls is None:
        return text.strip(), []
    return content.strip(), calls


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    """Mistral's ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` (an "id" is
    ignored); what precedes the marker is content. A list that does not parse is content as written."""
    head, marker, tail = text.partition(MISTRAL_TOOL_CALLS)
    if not marker:
        return text.strip(), []
    try:
        value, end = json.JSONDecoder().raw_decode(tail.lstrip())
    except json.JSONDecodeError:
        return text.strip(), []
    items = value if isinstance(value, list) else [value]
    calls = [tool_call(item, ("arguments", "parameters")) for item in items]
    if not calls or any(call is None for call in calls) or tail.lstrip()[end:].strip():
        return text.strip(), []
    return head.strip(), calls  # type: ignore[return-value]


PARSERS: dict[str, Parser] = {
    QWEN_FORMAT: parse_qwen,
    LLAMA3_FORMAT: parse_llama3,
    MISTRAL_FORMAT: parse_mistral,
}
"""format name -> parser"""
MARKERS: dict[str, tuple[str, ...]] = {
    QWEN_FORMAT: ("<tool_call>", "</tool_call>"),
    LLAMA3_FORMAT: (PYTHON_TAG,),
    MISTRAL_FORMAT: (MISTRAL_TOOL_CALLS,),
}
"""format name -> tokens that must survive decoding"""
FORMATS = tuple(PARSERS)


def parser_for(tool_call_format: str) -> Parser:
    """The parser of a format; a ValueError names the known ones."""
    try:
        return PARSERS[tool_call_format]
    except KeyError:
        raise ValueError(
            f"unknown tool-call format {tool_call_format!r}; known: {', '.join(FORMATS)}"
        ) from None


def parse_tool_calls(text: str, tool_call_format: str = QWEN_FORMAT) -> tuple[str, list[ToolCall]]:
    """(content, calls) of generated ``text`` in ``tool_call_format``."""
    return parser_for(tool_call_format)(text)


def _json_calls(body: str, *, separator: str, arguments_keys: tuple[str, ...]) -> list[ToolCall] | None:
    """The calls of a run of JSON objects joined by ``separator``, or None unless all of it parses."""
    decoder, calls, rest = json.JSONDecoder(), [], body.strip()
    if not rest.startswith("{"):
        return None
    while rest:
        try:
            value, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return None
        call = tool_call(value, arguments_keys)
        if call is None:
            return None
        calls.append(call)
        rest = rest[end:].strip()
        if rest.startswith(separator):
            rest = rest[len(separator) :].strip()
            if not rest:
                return None
        elif rest:
            return None
    return calls
