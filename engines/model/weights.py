"""Weight files: every read and write of policy weights goes through here.

Two formats:

- A policy version: one safetensors file whose metadata holds ``{"version": "<n>"}``. The core cell
  writes one per optimizer step (``save_weights``: tied tensors stored once, written under a
  temporary name then renamed, so a reader never sees half a file); engines and satellites read it
  back (``read_weights``), refusing a version they did not expect.
- A Hugging Face model folder (``config.json``, ``*.safetensors``, tokenizer files) on a local path
  or any fsspec URL: ``load_model`` builds the causal LM from it with transformers, local files only
  (a remote folder is fetched into the local cache first, `storage.fetch_folder`), SDPA attention
  (tree-packed training needs an attention that honours a 4D mask). ``read_weights`` also takes such
  a folder and returns the tensors of all its safetensors files.

``read_weights`` reads a local path, or any fsspec URL (``s3://bucket/campaign/policy/v3/model.safetensors``,
``file://...``):
an engine on another host loads a version from the campaign's object storage, read into memory (no
local copy; S3 credentials and endpoint from the environment, ``AWS_ENDPOINT_URL`` for a non-AWS one).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engines.model.storage import fetch_folder

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VERSION_KEY = "version"  # the safetensors metadata key of a policy version


def save_weights(state: dict[str, torch.Tensor], path: str | os.PathLike, version: int) -> None:
    """Writes ``state`` as policy ``version``: tied tensors (lm_head = embeddings) once, atomically.
    ``path`` may be an fsspec URL (one whole-object write: S3 shows it complete or not at all)."""
    path = str(path)
    unique = _unique_tensors(state)
    if "://" in path:
        import fsspec
        from safetensors.torch import save as save_bytes

        fs, root = fsspec.core.url_to_fs(path)
        fs.makedirs(fs._parent(root), exist_ok=True)
        fs.pipe_file(root, save_bytes(unique, metadata={VERSION_KEY: str(version)}))
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(unique, tmp, metadata={VERSION_KEY: str(version)})
    os.replace(tmp, path)


def remove_file(path: str) -> None:
    """Deletes a weights file (a local path or an fsspec URL); one already gone is fine."""
    if "://" not in path:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(root)


def _unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each tensor that shares storage with an earlier one left out, contiguous, on the CPU."""
    unique = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        unique[name] = tensor.detach().contiguous().cpu()
    return unique


def read_weights(
    path: str | os.PathLike, expected_version: int | None = None
) -> tuple[dict[str, torch.Tensor], int | None]:
    """The tensors of a safetensors file, or of every ``*.safetensors`` of an HF folder, and the policy
    version in their metadata (None when there is none). With ``expected_version``, a file holding
    another version is refused (ValueError) before its tensors are read."""
    path = str(path)
    if "://" in path:
        return _read_remote_weights(path, expected_version)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    metas = []
    for file in files:
        with safe_open(file, framework="pt") as handle:
            metas.append(handle.metadata() or {})
    version = _checked_version(metas, path, expected_version)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state, version


def _checked_version(metas: list[dict[str, str]], where: str, expected: int | None) -> int | None:
    """The policy version the files' metadata holds (the last file that names one); with ``expected``,
    another one is refused."""
    version = None
    for meta in metas:
        if VERSION_KEY in meta:
            version = int(meta[VERSION_KEY])
    if expected is not None and version != expected:
        raise ValueError(f"{where} holds policy version {version}, expected {expected}")
    return version


def _safetensors_metadata(data: bytes, where: str) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file held in memory (8-byte header length, JSON header)."""
    if len(data) < 8:
        raise ValueError(f"{where} is not a safetensors file: {len(data)} bytes")
    length = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + length])
    except ValueError as exc:
        raise ValueError(f"{where} is not a safetensors file: {exc}") from exc
    return header.get("__metadata__") or {}


def _read_remote_weights(
    url: str, expected_version: int | None
) -> tuple[dict[str, torch.Tensor], int | None]:
    """``read_weights`` of a file or folder at an fsspec URL, each file read into memory once."""
    import fsspec
    from safetensors.torch import load as load_bytes

    fs, root = fsspec.core.url_to_fs(url)
    files = sorted(fs.glob(f"{root.rstrip('/')}/*.safetensors")) if fs.isdir(root) else [root]
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {url}")
    blobs = {file: fs.cat_file(file) for file in files}
    metas = [_safetensors_metadata(data, f"{url} ({file})") for file, data in blobs.items()]
    version = _checked_version(metas, url, expected_version)
    state: dict[str, torch.Tensor] = {}
    for data in blobs.values():
        state.update(load_bytes(data))
    return state, version


def load_model(
    url_or_path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    *,
    s3_endpoint_url: str | None = None,
    cache_dir: str | Path | None = None,
) -> PreTrainedModel:
    """The causal LM of the HF folder at ``url_or_path``, in eval mode on ``device``; ``dtype`` None
    keeps the saved one."""
    from transformers import AutoModelForCausalLM

    folder = fetch_folder(str(url_or_path), s3_endpoint_url=s3_endpoint_url, cache_dir=cache_dir)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="sdpa", dtype=dtype or "auto", local_files_only=True
    )
    return model.to(device).eval()
