"""The chat format of the policy: ChatML turns, Qwen2.5-style tools, and tool-call parsing.

Pure Python (no torch, no transformers), so the gateway can import it cheaply.

A conversation renders as one ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` turn per message. A
``tools`` list goes into the system turn, each tool as JSON inside ``<tools></tools>``. An assistant
turn's ``tool_calls`` render as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
blocks, and ``tool`` messages become a user turn holding one ``<tool_response>`` block per result
(consecutive results share a turn). `parse_tool_calls` is the inverse for what the model generates.
"""

from __future__ import annotations

import json
import re
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"

CONTROL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Special tokens: never produced by plain text, dropped by ``decode(skip_special_tokens=True)``."""
TOOL_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
"""Added tokens that stay in decoded text (a tool-call parser needs to see them), as in Qwen2.5."""

TOOL_CALL_FORMAT = "qwen2.5-xml-json"
"""The name of this tool-call format, stored in tokenizer_config.json as ``gyre_tool_call_format``."""

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# {{ render(content) }}: a string, or the text parts of a list of {"type": "text", "text": ...}
# (every family's template starts with it: families.py)
RENDER_MACRO = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is none -%}"
    "{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}\n"
)

# The Qwen2.5 template, with two additions: tool-call arguments given as a JSON string (the OpenAI
# wire format) are inserted as they are rather than encoded twice, and content may be a list of
# {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = RENDER_MACRO + (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- render(messages[0].content) }}\n"
    "    {%- else %}\n"
    "        {{- '" + DEFAULT_SYSTEM_PROMPT + "' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + render(messages[0].content) + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + render(message.content) + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + render(message.content) }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {%- if tool_call.arguments is string %}\n"
    "                {{- tool_call.arguments }}\n"
    "            {%- else %}\n"
    "                {{- tool_call.arguments | tojson }}\n"
    "            {%- endif %}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- render(message.content) }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_TOOL_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Splits generated text into (content, tool calls), each call ``{"name": str, "arguments": dict}``.

    A ``<tool_call>`` block whose body is not a JSON object with a string ``name`` and object
    ``arguments`` (a JSON string holding an object is accepted too) stays in the content as written,
    as does an unclosed block: the caller sees what the model said and nothing raises. The content is
    the text with the parsed blocks removed, stripped of surrounding whitespace.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL_BLOCK.finditer(text):
        call = _parse_call(match.group(1))
        if call is None:
            continue  # left in place: the next kept slice covers it
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return tool_call(value)


def tool_call(value: Any, arguments_keys: tuple[str, ...] = ("arguments",)) -> dict[str, Any] | None:
    """``{"name", "arguments"}`` from a decoded call object, or None when it is not one: a string name and
    an object of arguments under the first of ``arguments_keys`` present (a JSON string holding an object
    is accepted too; none present: no arguments). Every tool-call format's parser uses it."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = {}
    for key in arguments_keys:
        if key in value:
            arguments = value[key]
            break
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": arguments}
