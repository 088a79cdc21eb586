"""Loads a policy's tokenizer from a local folder or any fsspec URL, never from a hub.

A remote folder is fetched into the local cache first (`storage.fetch_folder`, tokenizer files only);
transformers then reads it with ``local_files_only=True``. The model's weights load through
`weights.load_model`.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engines.model.storage import TOKENIZER_FILE_PATTERNS, fetch_folder


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
