"""The model families gyre builds and trains: Qwen2, Qwen3, Llama and Mistral, each with its chat format.

Pure Python (no torch, no transformers): the tokens, chat template and tool-call format of each family,
for `build.py` (a tiny random model of any family: ``gyre model init --family llama``) and for
`policy.py` (which family a user's folder is).

    family   model_type  architecture          tool-call format   chat template
    qwen2    qwen2       Qwen2ForCausalLM      qwen2.5-xml-json   CHAT_TEMPLATE (chat.py): ChatML + <tool_call>
    qwen3    qwen3       Qwen3ForCausalLM      qwen2.5-xml-json   the same (Qwen3 calls tools as Qwen2.5 does)
    llama    llama       LlamaForCausalLM      llama3-json        LLAMA3_TEMPLATE: Llama 3.1 headers, JSON calls
    mistral  mistral     MistralForCausalLM    mistral            MISTRAL_TEMPLATE: [INST] turns, [TOOL_CALLS]

The Llama and Mistral templates here are written for gyre in the families' formats (special tokens,
turn layout, how calls and results are written), not copies of the vendors' files; a real model's
folder brings its own template, which the gateway renders with as it is. Like CHAT_TEMPLATE, they
insert tool-call arguments given as a JSON string (the OpenAI wire format) as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engines.model.chat import CHAT_TEMPLATE, CONTROL_TOKENS, ENDOFTEXT, IM_END, RENDER_MACRO, TOOL_TOKENS
from engines.model.chat import TOOL_CALL_FORMAT as QWEN_FORMAT
from engines.model.tool_calls import LLAMA3_FORMAT, MISTRAL_FORMAT, MISTRAL_TOOL_CALLS, PYTHON_TAG

FamilyName = Literal["qwen2", "qwen3", "llama", "mistral"]

# render(content) (chat.py), and {{ arguments(call) }}: a call's arguments as a JSON string, inserted as
# they are when given as one; then the bos token, and `system` (the first message's text if it is the
# system's, else '') apart from `rest`, the messages that follow it
_PREAMBLE = RENDER_MACRO + (
    "{%- macro arguments(call) -%}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}"
    "{%- endif -%}"
    "{%- endmacro -%}\n"
    "{{- bos_token }}\n"
    "{%- if messages and messages[0].role == 'system' %}\n"
    "    {%- set system = render(messages[0].content) %}\n"
    "    {%- set rest = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system = '' %}\n"
    "    {%- set rest = messages %}\n"
    "{%- endif %}\n"
)

LLAMA3_TEMPLATE = _PREAMBLE + (
    "{%- if system or tools %}\n"
    "    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system }}\n"
    "    {%- if tools %}\n"
    "        {{- '\\n\\nYou have access to the following functions. To call one, answer with only a JSON '"
    ' + \'object {"name": function name, "parameters": dictionary of argument name and its value}.\\n\' }}\n'
    "        {%- for tool in tools %}\n"
    "            {{- '\\n' + (tool | tojson) }}\n"
    "        {%- endfor %}\n"
    "    {%- endif %}\n"
    "    {{- '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in rest %}\n"
    "    {%- if message.role == 'assistant' and message.tool_calls %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "        {%- for call in message.tool_calls %}\n"
    "            {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}\n"
    "            {%- if not loop.first %}{{- '; ' }}{%- endif %}\n"
    "            {{- '{\"name\": \"' + call.name + '\", \"parameters\": ' + arguments(call) + '}' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|eot_id|>' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + render(message.content) + '<|eot_id|>' }}\n"
    "    {%- else %}\n"
    "        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + render(message.content)"
    " + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

MISTRAL_TEMPLATE = _PREAMBLE + (
    "{%- if tools %}\n"
    "    {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}\n"
    "{%- endif %}\n"
    "{%- for message in rest %}\n"
    "    {%- if message.role == 'user' %}\n"
    "        {%- if loop.first and system %}\n"
    "            {{- '[INST]' + system + '\\n\\n' + render(message.content) + '[/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST]' + render(message.content) + '[/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message.role == 'assistant' and message.tool_calls %}\n"
    "        {{- '[TOOL_CALLS][' }}\n"
    "        {%- for call in message.tool_calls %}\n"
    "            {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}\n"
    "            {%- if not loop.first %}{{- ', ' }}{%- endif %}\n"
    "            {{- '{\"name\": \"' + call.name + '\", \"arguments\": ' + arguments(call) + '}' }}\n"
    "        {%- endfor %}\n"
    "        {{- ']' + eos_token }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- render(message.content) + eos_token }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {{- '[TOOL_RESULTS]' + ({'content': render(message.content)} | tojson) + '[/TOOL_RESULTS]' }}\n"
    "    {%- elif message.role == 'system' %}\n"
    "        {{- '[INST]' + render(message.content) + '[/INST]' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)


@dataclass(frozen=True)
class Family:
    """What a family's tokenizer and chat format hold (the architecture comes from its model_type)."""

    name: FamilyName
    model_type: str
    """config.json's model_type, and the transformers architecture: AutoModelForCausalLM's key"""
    tool_call_format: str
    chat_template: str
    special: tuple[str, ...]
    """control tokens, added as special (decode(skip_special_tokens=True) drops them)"""
    added: tuple[str, ...]
    """tokens added as plain (they stay in decoded text)"""
    bos: str | None
    eos: str
    """the end of an assistant turn"""
    pad: str
    stops: tuple[str, ...]
    """generation_config.json's eos tokens: the turn's end and the document's end"""


_QWEN = {  # qwen2 and qwen3 write the same template and tokens
    "tool_call_format": QWEN_FORMAT,
    "chat_template": CHAT_TEMPLATE,
    "special": CONTROL_TOKENS,
    "added": TOOL_TOKENS,
    "bos": None,
    "eos": IM_END,
    "pad": ENDOFTEXT,
    "stops": (IM_END, ENDOFTEXT),
}
FAMILIES: dict[str, Family] = {
    "qwen2": Family("qwen2", "qwen2", **_QWEN),
    "qwen3": Family("qwen3", "qwen3", **_QWEN),
    "llama": Family(
        "llama",
        "llama",
        tool_call_format=LLAMA3_FORMAT,
        chat_template=LLAMA3_TEMPLATE,
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            PYTHON_TAG,
        ),
        added=(),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        stops=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    ),
    "mistral": Family(
        "mistral",
        "mistral",
        tool_call_format=MISTRAL_FORMAT,
        chat_template=MISTRAL_TEMPLATE,
        special=(
            "<unk>",
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            MISTRAL_TOOL_CALLS,
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        added=(),
        bos="<s>",
        eos="</s>",
        pad="<unk>",
        stops=("</s>",),
    ),
}
"""family name -> Family"""
