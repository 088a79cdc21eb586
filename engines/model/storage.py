"""Model folders in object storage: publish a local folder to any fsspec URL, fetch one back, load it.

transformers reads only local folders (we never let it reach a hub), so a remote model is copied
into a local cache first. A cache entry is keyed by the URL and the content of the folder: the
full bytes of the small JSON files and, for the weights, their size and the store's content tag
(the S3 ETag, an MD5 of the bytes for a single-part upload). A model rewritten in place thus gets a
fresh entry. Entries appear whole: files land in a temporary folder that is renamed into place.

S3 options are those of the trajectory store (`trajectory_store.storage.StoreConfig`): an explicit
endpoint, else the standard AWS variables, which s3fs reads itself.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import shutil
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from trajectory_store.storage import StoreConfig

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "gyre" / "models"
WRITTEN_LAST = "config.json"  # a reader that sees config.json sees every other file too
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    *_TOKENIZER_FILES,
)
"""Files of a Hugging Face model folder: what ``--force`` may replace and what loaders fetch."""
TOKENIZER_FILE_PATTERNS = (
    *_TOKENIZER_FILES,
    "config.json",  # AutoTokenizer reads the model type from it when tokenizer_config.json lacks a class
)
SMALL_FILE_BYTES = 64 << 20  # files up to this size are hashed by content for the cache key


def filesystem(url: str, s3_endpoint_url: str | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path without a trailing slash) for a local folder or any fsspec URL."""
    options = StoreConfig(data_root=url, s3_endpoint_url=s3_endpoint_url).storage_options()
    fs, root = fsspec.core.url_to_fs(url, **options)
    return fs, root.rstrip("/") or root


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def is_model_file(name: str, patterns: tuple[str, ...] = MODEL_FILE_PATTERNS) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _existing_files(fs: fsspec.AbstractFileSystem, root: str) -> list[str]:
    """Paths of the files under ``root`` (itself, if it is a file); empty when nothing is there."""
    if isinstance(fs, LocalFileSystem) and os.path.isfile(root):
        return [root]
    try:
        return sorted(fs.find(root))
    except FileNotFoundError:
        return []


def check_destination(url: str, *, force: bool, s3_endpoint_url: str | None = None) -> None:
    """Raises FileExistsError if ``url`` already holds files and ``force`` is not set."""
    fs, root = filesystem(url, s3_endpoint_url)
    if isinstance(fs, LocalFileSystem) and os.path.isfile(root):
        raise FileExistsError(f"{url} is a file, not a folder")
    existing = _existing_files(fs, root)
    if existing and not force:
        shown = ", ".join(posixpath.relpath(p, root) for p in existing[:5])
        more = f" and {len(existing) - 5} more" if len(existing) > 5 else ""
        raise FileExistsError(
            f"{url} is not empty ({shown}{more}); pass --force to replace the model files there"
        )


def publish_folder(
    local_dir: str | Path, url: str, *, force: bool = False, s3_endpoint_url: str | None = None
) -> list[str]:
    """Copies the files of a local folder to ``url``; config.json goes last. Returns the names copied.

    With ``force``, model files already at ``url`` that this copy does not overwrite (an old shard,
    a stale chat_template.jinja) are deleted first, so the destination loads as exactly this model.
    """
    check_destination(url, force=force, s3_endpoint_url=s3_endpoint_url)
    fs, root = filesystem(url, s3_endpoint_url)
    local_dir = Path(local_dir)
    names = sorted(p.name for p in local_dir.iterdir() if p.is_file())
    if force:
        for path in _existing_files(fs, root):
            name = posixpath.relpath(path, root)
            if "/" not in name and name not in names and is_model_file(name):
                fs.rm_file(path)
    if isinstance(fs, LocalFileSystem):
        fs.makedirs(root, exist_ok=True)
    for name in sorted(names, key=lambda n: (n == WRITTEN_LAST, n)):
        fs.put_file(str(local_dir / name), f"{root}/{name}")
    return names


def fetch_folder(
    url: str,
    *,
    patterns: tuple[str, ...] = MODEL_FILE_PATTERNS,
    s3_endpoint_url: str | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """A local folder holding the files of ``url`` that match ``patterns``: the folder itself if local,
    else a cache entry (downloaded once per URL and content)."""
    if is_local(url):
        folder = Path(url.removeprefix("file://"))
        if not folder.is_dir():
            raise FileNotFoundError(f"no model folder at {url}")
        return folder
    fs, root = filesystem(url, s3_endpoint_url)
    listing: dict[str, dict[str, Any]] = fs.find(root, detail=True)
    entries = {
        posixpath.relpath(path, root): info
        for path, info in listing.items()
        if info.get("type", "file") == "file" and is_model_file(posixpath.relpath(path, root), patterns)
    }
    if not any(name in entries for name in ("config.json", "tokenizer.json")):
        raise FileNotFoundError(f"no model or tokenizer at {url} (no config.json or tokenizer.json there)")
    key = _cache_key(fs, root, url, entries)
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    target = cache / key
    if target.is_dir():
        return target
    staging = cache / f".{key}.tmp-{uuid.uuid4().hex}"
    staging.mkdir(parents=True)
    try:
        for name in entries:
            fs.get_file(f"{root}/{name}", str(staging / name))
        try:
            os.replace(staging, target)
        except OSError:
            if not target.is_dir():  # another process won the race when the target exists
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _cache_key(fs: fsspec.AbstractFileSystem, root: str, url: str, entries: dict[str, dict[str, Any]]) -> str:
    identity: list[Any] = [url.rstrip("/")]
    for name, info in sorted(entries.items()):
        size = int(info.get("size") or 0)
        if size <= SMALL_FILE_BYTES and name.endswith(".json"):
            tag = hashlib.sha256(fs.cat_file(f"{root}/{name}")).hexdigest()
        else:
            tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or fs.ukey(f"{root}/{name}")
        identity.append([name, size, str(tag)])
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
    return digest
