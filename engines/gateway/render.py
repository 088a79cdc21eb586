"""Renderers of a conversation into the policy's chat-template text.

    TemplateRenderer   any tokenizer: transformers' apply_chat_template (Jinja), the whole conversation
                       every time; not incremental (context.py verifies its prefixes by text hash)
    ChatMLRenderer     the project's CHAT_TEMPLATE (engines/model/chat.py) in plain Python, exact to the
                       character (tests/test_gateway_fidelity.py checks it against Jinja on random
                       conversations, and ChatCodec checks it on a probe before using it) and incremental:
                       ``continuation(messages, tools, start)`` renders only messages[start:]

Why: rendering a long agent conversation through Jinja costs ~50 us per message; at a few hundred
messages that alone would exceed the gateway's per-call budget. In CHAT_TEMPLATE a message's text depends
only on itself, its neighbours' roles (consecutive tool results share one user turn) and whether it is
first; the system turn depends on the tools and the first message. So the text after a closed prefix
messages[:start] depends only on messages[start - 1:] (plus the first message and the tools, which the
caller's prefix match already pins), unless messages[start - 1] and messages[start] are both tool
results: then the prefix's last turn was not closed where the cached text closed it, and
``continuation`` answers None (the caller falls back to a shorter prefix).
"""

from __future__ import annotations

import json
from typing import Any

from engines.model.chat import CHAT_TEMPLATE, DEFAULT_SYSTEM_PROMPT, IM_END, IM_START

_TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>" + IM_END + "\n"
)
_GENERATION = IM_START + "assistant\n"


class TemplateRenderer:
    """The tokenizer's own chat template through transformers (any model)."""

    incremental = False

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], tools: list[dict] | None, *, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation
        )

    def continuation(
        self, messages: list[dict], tools: list[dict] | None, start: int, *, generation: bool
    ) -> str | None:
        return None


class ChatMLRenderer:
    """CHAT_TEMPLATE, natively. Only valid for a tokenizer whose chat_template is exactly CHAT_TEMPLATE."""

    incremental = True
    template = CHAT_TEMPLATE

    def render(self, messages: list[dict], tools: list[dict] | None, *, generation: bool) -> str:
        pieces = [self._system(messages, tools)]
        pieces += [self._message(messages, i) for i in range(len(messages))]
        if generation:
            pieces.append(_GENERATION)
        return "".join(pieces)

    def continuation(
        self, messages: list[dict], tools: list[dict] | None, start: int, *, generation: bool
    ) -> str | None:
        if start < 1:
            return None
        if start < len(messages) and messages[start - 1].get("role") == messages[start].get("role") == "tool":
            return None
        pieces = [self._message(messages, i) for i in range(start, len(messages))]
        if generation:
            pieces.append(_GENERATION)
        return "".join(pieces)

    def _system(self, messages: list[dict], tools: list[dict] | None) -> str:
        first = messages[0] if messages else {}
        system = _content(first.get("content")) if first.get("role") == "system" else None
        if tools:
            text = system if system is not None else DEFAULT_SYSTEM_PROMPT
            listed = "".join("\n" + _tojson(tool) for tool in tools)
            return IM_START + "system\n" + text + _TOOLS_INTRO + listed + _TOOLS_OUTRO
        return (
            IM_START + "system\n" + (system if system is not None else DEFAULT_SYSTEM_PROMPT) + IM_END + "\n"
        )

    def _message(self, messages: list[dict], i: int) -> str:
        message = messages[i]
        role = message.get("role")
        calls = message.get("tool_calls")
        if role == "user" or (role == "system" and i > 0) or (role == "assistant" and not calls):
            return IM_START + role + "\n" + _content(message.get("content")) + IM_END + "\n"
        if role == "assistant":
            out = IM_START + role
            if _truthy(message.get("content")):
                out += "\n" + _content(message.get("content"))
            for call in calls:
                if isinstance(call, dict) and "function" in call:
                    call = call["function"]
                arguments = call.get("arguments")
                arguments = arguments if isinstance(arguments, str) else _tojson(arguments)
                out += '\n<tool_call>\n{"name": "' + str(call.get("name")) + '", "arguments": '
                out += arguments + "}\n</tool_call>"
            return out + IM_END + "\n"
        if role == "tool":
            out = ""
            if i == 0 or messages[i - 1].get("role") != "tool":
                out += IM_START + "user"
            out += "\n<tool_response>\n" + _content(message.get("content")) + "\n</tool_response>"
            if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
                out += IM_END + "\n"
            return out
        return ""  # the first system message is in the system turn; unknown roles render nothing


def _content(content: Any) -> str:
    """The template's render() macro."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return "".join(
        str(part["text"]) if "text" in part else ""  # as Jinja prints a value (None, True: their names)
        for part in content
        if isinstance(part, dict) and part.get("type") == "text"
    )


def _truthy(content: Any) -> bool:
    return bool(content)


def _tojson(value: Any) -> str:
    """transformers' tojson filter (json.dumps, ensure_ascii=False)."""
    return json.dumps(value, ensure_ascii=False)
