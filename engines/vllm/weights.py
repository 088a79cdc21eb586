"""The policy as vLLM reads it: safetensors headers read without torch, and tied embeddings untied.

vLLM 0.32 reloads weights in place layer by layer, and a tied output head (``tie_word_embeddings``: the
head shares the input embeddings) is not reloaded: its layer warns "ParallelLMHead: Failed to load
weights" and keeps the old values, so after a reload the model samples from new layers and an old head
(measured here: logprobs off by 2.6 nats against the new policy). So a tied policy is served untied:
the folder vLLM loads is a view of the policy (links to its files) whose config.json says
``tie_word_embeddings: false`` and whose ``lm_head.safetensors`` holds a copy of the embeddings under
the head's name. Same math, one more copy of the embeddings in memory; every new version gets its head
the same way. Nothing here imports torch: tensors are copied as bytes.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
VERSION_KEY = "version"  # the safetensors metadata key of a policy version (engines/model/weights.py)


def safetensors_files(path: str) -> list[Path]:
    """The safetensors files of a file or a folder; FileNotFoundError when there are none."""
    files = sorted(Path(path).glob("*.safetensors")) if os.path.isdir(path) else [Path(path)]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors file at {path}")
    return files


def read_header(file: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets; __metadata__) and where
    its data begins."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def policy_version_of(path: str) -> int | None:
    """The 'version' metadata of the (first) safetensors file of ``path``; None when it has none."""
    header, _ = read_header(safetensors_files(path)[0])
    version = (header.get("__metadata__") or {}).get(VERSION_KEY)
    return int(version) if version is not None else None


def is_tied(model_dir: str) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def write_head(path: str, out: Path) -> None:
    """``out``: one safetensors file holding the embeddings of ``path`` as lm_head.weight."""
    for file in safetensors_files(path):
        header, start = read_header(file)
        if EMBED in header:
            entry = header[EMBED]
            begin, end = entry["data_offsets"]
            with open(file, "rb") as f:
                f.seek(start + begin)
                data = f.read(end - begin)
            head = {HEAD: {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [0, len(data)]}}
            encoded = json.dumps(head).encode()
            encoded += b" " * (-len(encoded) % 8)  # the data begins 8-byte aligned
            out.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
            return
    raise ValueError(f"{path} has no {EMBED}: cannot give its tied output head to vLLM")


def serving_folder(model_dir: str, scratch: Path) -> str:
    """The folder vLLM starts from: ``model_dir`` itself, or for a tied policy its untied view."""
    if not is_tied(model_dir):
        return model_dir
    view = Path(tempfile.mkdtemp(prefix="policy-", dir=scratch))
    for item in Path(model_dir).iterdir():
        if item.name != "config.json":
            (view / item.name).symlink_to(item.resolve())
    config = json.loads((Path(model_dir) / "config.json").read_text())
    (view / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    write_head(model_dir, view / "lm_head.safetensors")
    return str(view)


def weights_folder(path: str, scratch: Path, *, tied: bool) -> str:
    """The folder vLLM's reload reads for the version at ``path`` (a safetensors file or an HF folder):
    links to its safetensors files, and for a tied policy the head copied from its embeddings."""
    files = safetensors_files(path)
    if os.path.isdir(path) and not tied:
        return path
    folder = Path(tempfile.mkdtemp(prefix="weights-", dir=scratch))
    for index, file in enumerate(files):
        (folder / f"model-{index:05d}.safetensors").symlink_to(file.resolve())
    if tied:
        write_head(path, folder / "lm_head.safetensors")
    return str(folder)
