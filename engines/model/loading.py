"""Loads a policy model or tokenizer from a local folder or any fsspec URL, never from a hub.

A remote folder is fetched into the local cache first (`storage.fetch_folder`); transformers then
reads it with ``local_files_only=True``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engines.model.storage import TOKENIZER_FILE_PATTERNS, fetch_folder


def load_model(
    url_or_path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    *,
    s3_endpoint_url: str | None = None,
    cache_dir: str | Path | None = None,
) -> PreTrainedModel:
    """The causal LM at ``url_or_path`` in eval mode on ``device``; ``dtype`` None keeps the saved one."""
    folder = fetch_folder(str(url_or_path), s3_endpoint_url=s3_endpoint_url, cache_dir=cache_dir)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or "auto", local_files_only=True)
    return model.to(device).eval()


def load_tokenizer(
    url_or_path: str | Path,
    *,
    s3_endpoint_url: str | None = None,
    cache_dir: str | Path | None = None,
) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) at ``url_or_path``; only tokenizer files are fetched."""
    folder = fetch_folder(
        str(url_or_path),
        patterns=TOKENIZER_FILE_PATTERNS,
        s3_endpoint_url=s3_endpoint_url,
        cache_dir=cache_dir,
    )
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
