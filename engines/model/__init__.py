"""The policy model: a causal LM (Qwen2 by default; Qwen3, Llama, Mistral) and a locally trained
byte-level BPE tokenizer, in HF format; or any user folder of those families (policy.py).

    gyre model init --preset tiny --out ./models/tiny [--seed 0] [--force]
    gyre model init --preset gpu-0.5b --out s3://bucket/models/p0 [--s3-endpoint-url URL]

``init`` writes ``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``
and ``tokenizer_config.json`` (with the chat template inline): a folder that
``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(..., local_files_only=True)``, vLLM and
our own engines read. Nothing comes from a hub: the tokenizer is trained at init time on a seeded
corpus the repo generates (`corpus.py`), in about a second, and the weights are seeded random draws.

Presets (Qwen2 decoders, tied embeddings, RoPE, SwiGLU, GQA, sdpa attention; parameters counted with
``sum(p.numel())`` over the built model, the tied output projection once)::

    preset     hidden  layers  heads  kv  intermediate  rope_theta  vocab  dtype     parameters
    tiny          256       4      4   2           384       1e4    4096  float32       3,019,008
    small         512      12      8   2          1536       1e4    8192  float32      40,392,192
    gpu-0.5b      896      24     14   2          4864       1e6    8192  bfloat16    365,238,144
    gpu-1.5b     1536      28     12   2          8960       1e6    8192  bfloat16  1,322,923,520

``gpu-0.5b`` and ``gpu-1.5b`` are exactly the Qwen2.5-0.5B / 1.5B shapes (their non-embedding counts,
357,898,112 and 1,310,340,608, match Qwen's), with our 8k vocabulary instead of 152k.

Pieces:
    config.py    ModelConfig (preset, seed, vocab_size, dtype) and the PRESETS table
    corpus.py    the deterministic tokenizer-training corpus
    tokenizer.py build_tokenizer / save_tokenizer: byte-level BPE + ChatML special tokens
    chat.py      CHAT_TEMPLATE (Qwen2.5 tools format) and parse_tool_calls; pure Python
    families.py  the families gyre builds (qwen2, qwen3, llama, mistral): tokens, chat template, tool format
    tool_calls.py  the tool-call formats and their parsers (Qwen/Hermes, Llama 3 JSON, Mistral); pure Python
    policy.py    inspect_policy: checks a user's HF folder (architecture, tokenizer, template, tool format)
    build.py     build_model (seeded per-parameter init), count_parameters, init_model
    storage.py   publish a folder to any fsspec URL, fetch one into the local cache
    weights.py   weight files: versioned safetensors (save_weights / read_weights), load_model from an
                 HF folder or URL
    loading.py   load_tokenizer from a folder or URL

Exports resolve lazily, so ``from engines.model import parse_tool_calls`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engines.model.build import InitResult, build_model, count_parameters, init_model
    from engines.model.chat import CHAT_TEMPLATE, TOOL_CALL_FORMAT, parse_tool_calls
    from engines.model.config import PRESETS, ModelConfig, Preset
    from engines.model.corpus import generate_corpus
    from engines.model.loading import load_tokenizer
    from engines.model.storage import fetch_folder, publish_folder
    from engines.model.tokenizer import SPECIAL_TOKENS, build_tokenizer, save_tokenizer
    from engines.model.weights import load_model, read_weights, save_weights

_EXPORTS = {
    "InitResult": "build",
    "build_model": "build",
    "count_parameters": "build",
    "init_model": "build",
    "CHAT_TEMPLATE": "chat",
    "TOOL_CALL_FORMAT": "chat",
    "parse_tool_calls": "chat",
    "PRESETS": "config",
    "ModelConfig": "config",
    "Preset": "config",
    "generate_corpus": "corpus",
    "load_model": "weights",
    "read_weights": "weights",
    "save_weights": "weights",
    "load_tokenizer": "loading",
    "fetch_folder": "storage",
    "publish_folder": "storage",
    "SPECIAL_TOKENS": "tokenizer",
    "build_tokenizer": "tokenizer",
    "save_tokenizer": "tokenizer",
}
__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "SPECIAL_TOKENS",
    "TOOL_CALL_FORMAT",
    "InitResult",
    "ModelConfig",
    "Preset",
    "build_model",
    "build_tokenizer",
    "count_parameters",
    "fetch_folder",
    "generate_corpus",
    "init_model",
    "load_model",
    "load_tokenizer",
    "parse_tool_calls",
    "publish_folder",
    "read_weights",
    "save_tokenizer",
    "save_weights",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
