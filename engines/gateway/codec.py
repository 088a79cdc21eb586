"""ChatCodec: the tokenizer side of the gateway. Renders OpenAI messages with the policy's chat template,
turns text into token ids and generated ids back into a message (content + parsed tool calls).

    codec = ChatCodec.from_folder("./models/tiny")
    text = codec.render(messages, tools, generation=True)    # the chat template, as a string
    ids = codec.encode(text)                                  # no BOS or other added ids
    content, calls = codec.parse_text(codec.decode(output_ids), tools_on=True)  # the family's parser

Splicing rule (context.py relies on it): the tokenizer cuts text at every added token (<|im_start|>,
<|im_end|>, the tool tags...) before its pre-tokenizer and BPE run, so for texts A and B where B starts
with an added token, encode(A + B) == encode(A) + encode(B). `starts_at_boundary` checks that condition.

Threads: encode, decode and render may run on the gateway's tokenizer threads (service.py runs large
prompts there) while the event loop encodes small texts; a text above 4K characters is encoded with the
GIL released, so a long tokenization does not stall the loop.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from engines.gateway.render import ChatMLRenderer, TemplateRenderer
from engines.model.chat import ENDOFTEXT, IM_END
from engines.model.chat import TOOL_CALL_FORMAT as QWEN_FORMAT
from engines.model.tool_calls import MARKERS, parser_for

# longer texts are encoded with the GIL released (encode_batch), so other threads run meanwhile
_GIL_FREE_CHARS = 4096

# a conversation touching every branch of CHAT_TEMPLATE, for the native renderer's self-check
_PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {
        "role": "assistant",
        "content": "c",
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": {"y": [1, "é"]}}},
        ],
    },
    {"role": "tool", "tool_call_id": "1", "content": "r1"},
    {"role": "tool", "tool_call_id": "2", "content": None},
    {"role": "assistant", "content": "d"},
    {"role": "system", "content": "late"},
]
_PROBE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class ChatCodec:
    """Attributes: tokenizer (a transformers tokenizer with a chat template), tool_call_format (how the
    model writes calls: engines/model/tool_calls.py), eos_id (the end-of-turn token the template writes
    after an assistant message), stop_ids (sent with every engine request), boundaries (added-token
    strings), generation_suffix / generation_ids (what add_generation_prompt adds)."""

    def __init__(
        self,
        tokenizer: Any,
        extra_stop_ids: list[int] | None = None,
        tool_call_format: str = QWEN_FORMAT,
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template: the gateway needs one to render messages")
        self.tokenizer = tokenizer
        self.tool_call_format = tool_call_format
        self._parse_tool_calls = parser_for(tool_call_format)
        self.renderer = self._pick_renderer(tokenizer)
        # transformers' encode / decode wrap the Rust tokenizer in ~0.2 ms of Python per call; with no
        # text clean-up configured, calling the backend directly gives the same ids and text
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = backend if backend is not None and plain else None
        self._lock = threading.Lock()
        vocab = tokenizer.get_vocab()
        chatml = IM_END in vocab and IM_END in tokenizer.chat_template
        self.eos_token: str = IM_END if chatml else tokenizer.eos_token
        self.eos_id: int = vocab[self.eos_token]
        # decoding drops special tokens but keeps the ones the tool-call parser reads (Llama's
        # <|python_tag|>, Mistral's [TOOL_CALLS] are special in their tokenizers)
        kept = {vocab[m] for m in MARKERS[tool_call_format] if m in vocab}
        special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        self._dropped_on_decode: frozenset[int] = frozenset(special - kept)
        stops = {self.eos_id, *(extra_stop_ids or [])}
        if ENDOFTEXT in vocab:
            stops.add(vocab[ENDOFTEXT])
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        self.stop_ids: list[int] = sorted(stops)
        self.boundaries: tuple[str, ...] = tuple(sorted(tokenizer.get_added_vocab(), key=len, reverse=True))
        probe = [{"role": "user", "content": "x"}]
        with_prompt = self.render(probe, None, generation=True)
        without = self.render(probe, None, generation=False)
        if not with_prompt.startswith(without):
            raise ValueError("the chat template's generation prompt is not a suffix of the conversation")
        self.generation_suffix: str = with_prompt[len(without) :]
        self.generation_ids: list[int] = self.encode(self.generation_suffix)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> ChatCodec:
        """The tokenizer of an HF model folder, with the tool-call format found there
        (engines/model/policy.py: a PolicyError when it cannot be told); the stop ids also take
        generation_config.json's eos ids."""
        from engines.model.loading import load_tokenizer
        from engines.model.policy import tool_call_format_of

        tool_call_format, _ = tool_call_format_of(folder)
        tokenizer = load_tokenizer(folder)
        extra: list[int] = []
        config_path = os.path.join(str(folder), "generation_config.json")
        if os.path.exists(config_path):
            with open(config_path) as handle:
                eos = json.load(handle).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(tokenizer, extra, tool_call_format)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @staticmethod
    def _pick_renderer(tokenizer: Any) -> ChatMLRenderer | TemplateRenderer:
        """The native renderer when the tokenizer's template is CHAT_TEMPLATE and renders the probe the
        same way through Jinja; transformers' apply_chat_template otherwise."""
        jinja = TemplateRenderer(tokenizer)
        if tokenizer.chat_template != ChatMLRenderer.template:
            return jinja
        native = ChatMLRenderer()
        for tools in (None, _PROBE_TOOLS):
            for generation in (False, True):
                for messages in (_PROBE, _PROBE[1:4], _PROBE[3:]):
                    mine = native.render(messages, tools, generation=generation)
                    if mine != jinja.render(messages, tools, generation=generation):
                        return jinja
        return native

    def render(self, messages: list[dict], tools: list[dict] | None, *, generation: bool) -> str:
        return self.renderer.render(messages, tools, generation=generation)

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._backend is not None:
            if len(text) > _GIL_FREE_CHARS:
                # the backend's encode holds the GIL throughout (a 10 MB text froze every thread for
                # seconds); encode_batch releases it while it runs and gives the same ids
                return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
            return self._backend.encode(text, add_special_tokens=False).ids
        with self._lock:  # transformers sets truncation on the shared backend per call: not thread-safe
            return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` without special tokens, except the tool-call format's markers."""
        dropped = self._dropped_on_decode
        ids = [i for i in ids if i not in dropped]
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def starts_at_boundary(self, text: str) -> bool:
        """Whether tokenization splits right before ``text`` (it starts with an added token)."""
        return text.startswith(self.boundaries) if self.boundaries else False

    def parse_text(self, text: str, *, tools_on: bool) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls as {"name", "arguments": dict}) of decoded output text; with tools off the
        whole text is content. With tool calls, content is None when nothing else was said."""
        if not tools_on:
            return text, []
        content, calls = self._parse_tool_calls(text)
        return (content or None) if calls else content, calls

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id decoded alone (for OpenAI-style logprobs entries)."""
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
