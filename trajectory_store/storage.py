"""Object storage for the trajectory store: any fsspec URL, idempotent atomic writes, manifests.

Layout under ``<data_root>/campaigns/<campaign>/``::

    calls/step=<n>/part-<key>.parquet        delta-encoded calls (schema.CALLS_SCHEMA)
    executions/step=<n>/part-<key>.parquet   executions (schema.EXECUTIONS_SCHEMA)
    metrics/step=<n>/part-<key>.parquet      metrics
    manifests/step=<n>/<key>.json            written LAST: lists the parts a flush made visible
    quarantine/step=<n>/<key>.jsonl          records that failed validation, with the reason
    quarantine/parts/<kind>/step=<n>/…       unreadable parts moved aside by `gyre traj check
                                             --quarantine`, each with a .json saying why (parts.py)
    snapshots/step=<n>/part-<key>.parquet    workspace snapshots, one per part, one row per entry
                                             (snapshots.py; schema.SNAPSHOTS_SCHEMA)
    blobs/step=<n>/part-<key>.parquet        their file contents, each sha256 stored once
    snapshots/<execution_id>.tar.gz          the first snapshot format (still read; no longer written)

Readers only see parts listed by a manifest, so a crash between writes leaves nothing partial
visible. Keys derive from ids (never time or randomness): writing the same rows twice writes the
same objects again, and one copy stays. Each object is written whole: a temporary name plus a
rename on a local disk, a single PUT on S3. A committed part is never replaced by other content:
the same key with other rows is an error (StoreError), not an overwrite.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import uuid
from collections.abc import Iterable
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, Field

from trajectory_store.schema import SCHEMA_VERSION, SCHEMAS, check_table

KINDS = ("executions", "calls", "metrics", "snapshots", "blobs")
# Parquet writer options beyond the defaults, per dataset. A snapshot part holds one small snapshot:
# statistics only where queries filter, dictionaries only for columns that repeat, no Arrow schema
# copy (its types read back the same), which halves the fixed cost of a part (~5 KB -> ~2.5 KB).
# Blobs: statistics on the key only (never min/max of file contents), no dictionary of unique values,
# and zstd at level 9 (written once, read rarely: 7% fewer bytes than the default level on the bench).
PART_OPTIONS: dict[str, dict[str, Any]] = {
    "snapshots": {
        "write_statistics": ["execution_id", "problem_id", "step"],
        "use_dictionary": ["snapshot_id", "execution_id", "problem_id", "source", "template_id", "kind"],
        "store_schema": False,
    },
    "blobs": {"write_statistics": ["sha256"], "use_dictionary": False},
}
ZSTD_LEVELS = {"blobs": 9}
QUARANTINED_PARTS = "quarantine/parts"  # under the campaign folder


class StoreError(ValueError):
    """The store itself (an object, not one record) cannot be read or written as asked; names it."""


class StoreConfig(BaseModel):
    """Where trajectories live. Credentials fall back to the standard AWS variables when unset."""

    data_root: str = Field("./gyre-data", description="fsspec URL: a local folder or s3://bucket/prefix")
    campaign: str = Field("default", description="campaign name: one folder under campaigns/")
    s3_endpoint_url: str | None = Field(
        None, description="S3 API endpoint (default: AWS or AWS_ENDPOINT_URL)"
    )
    aws_access_key_id: str | None = Field(None, description="default: AWS_ACCESS_KEY_ID")
    aws_secret_access_key: str | None = Field(None, description="default: AWS_SECRET_ACCESS_KEY")
    aws_region: str | None = Field(None, description="default: AWS_DEFAULT_REGION")
    vocab_size: int | None = Field(None, description="token ids must be below this; None: any int32 >= 0")
    compression: str = Field("zstd", description="Parquet compression codec")
    duckdb_memory_limit: str | None = Field(
        None,
        pattern=r"^\s*\d+(\.\d+)?\s*([KMGT]i?B|B)\s*$",
        description="DuckDB's memory_limit for the trees, selection and packing queries (e.g. '2GB'): "
        "beyond it DuckDB spills to duckdb_temp_directory instead of growing. None: DuckDB's default "
        "(80% of the machine's memory)",
    )
    duckdb_temp_directory: str | None = Field(
        None, description="where DuckDB spills past its memory_limit (None: DuckDB's default, .tmp here)"
    )

    def storage_options(self) -> dict[str, Any]:
        if not self.data_root.startswith("s3://"):
            return {}
        options: dict[str, Any] = {}
        client_kwargs: dict[str, Any] = {}
        if self.s3_endpoint_url:
            client_kwargs["endpoint_url"] = self.s3_endpoint_url
        if self.aws_region:
            client_kwargs["region_name"] = self.aws_region
        if client_kwargs:
            options["client_kwargs"] = client_kwargs
        if self.aws_access_key_id:
            options["key"] = self.aws_access_key_id
        if self.aws_secret_access_key:
            options["secret"] = self.aws_secret_access_key
        # a fresh filesystem per store: no cross-test or cross-campaign cache surprises
        options["skip_instance_cache"] = True
        options["use_listings_cache"] = False
        return options


def ids_key(*parts: Iterable[Any]) -> str:
    """A short stable key derived from ids (never from time or randomness)."""
    digest = hashlib.sha256()
    for part in parts:
        for item in part:
            digest.update(repr(item).encode())
            digest.update(b"\x00")
        digest.update(b"\x01")
    return digest.hexdigest()[:20]


class Store:
    """One campaign's folder in object storage."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self.fs, root = fsspec.core.url_to_fs(config.data_root, **config.storage_options())
        self.protocol = "file" if isinstance(self.fs, LocalFileSystem) else self.fs.protocol
        if isinstance(self.protocol, tuple | list):
            self.protocol = self.protocol[0]
        self.root = root.rstrip("/")
        self.campaign_dir = f"{self.root}/campaigns/{config.campaign}"

    # -- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.campaign_dir, *parts])

    def url(self, path: str) -> str:
        """A URL DuckDB can open: a plain path locally, protocol://path otherwise."""
        return path if self.protocol == "file" else f"{self.protocol}://{path}"

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    # -- whole-object writes -----------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> None:
        """Writes an object whole or not at all."""
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    # -- datasets ----------------------------------------------------------------------------
    def write_part(self, kind: str, step: int, table: pa.Table, key: str) -> str:
        """Writes one Parquet part; returns its path relative to the campaign folder.

        Writing a part that exists with the same rows is a no-op (a retried flush); a committed part
        with other rows is never overwritten (StoreError), since its rows would silently vanish.
        """
        if kind not in SCHEMAS:
            raise ValueError(f"unknown dataset {kind!r}; expected one of {sorted(SCHEMAS)}")
        table = table.cast(SCHEMAS[kind])
        buffer = io.BytesIO()
        # page checksums let `gyre traj check` find flipped bits that would otherwise decode quietly
        options = dict(PART_OPTIONS.get(kind, {}))
        if self.config.compression == "zstd" and kind in ZSTD_LEVELS:
            options["compression_level"] = ZSTD_LEVELS[kind]
        pq.write_table(
            table, buffer, compression=self.config.compression, write_page_checksum=True, **options
        )
        rel = f"{kind}/step={step}/part-{key}.parquet"
        path = self.path(rel)
        data = buffer.getvalue()
        if self.exists(path) and not self._may_replace(rel, table, data):
            return rel
        self.write_bytes(path, data)
        return rel

    def _may_replace(self, rel: str, table: pa.Table, data: bytes) -> bool:
        """For a part that exists: False if it already holds these rows, True if it was never
        committed (a crash before its manifest), else StoreError."""
        existing = self.read_bytes(self.path(rel))
        if existing == data:
            return False
        unreadable = None
        try:
            if pq.read_table(io.BytesIO(existing)).equals(table):
                return False
        except (OSError, pa.ArrowException) as error:
            unreadable = str(error).splitlines()[0]
        if rel not in {r for m in self.manifests() for paths in m["files"].values() for r in paths}:
            return True
        if unreadable:
            raise StoreError(
                f"{self.url(self.path(rel))}: this committed part cannot be read ({unreadable}); "
                "`gyre traj check --quarantine` moves it aside, then write it again"
            )
        raise StoreError(
            f"{self.url(self.path(rel))}: this part is committed with other rows; refusing to "
            "overwrite it (the same ids were written with different content)"
        )

    def commit(self, step: int, parts: dict[str, list[str]], rows: dict[str, int]) -> str:
        """Writes the manifest that makes ``parts`` visible. Call it after every part is written."""
        files = {kind: sorted(set(paths)) for kind, paths in parts.items() if paths}
        key = ids_key([step], *[[kind, *paths] for kind, paths in sorted(files.items())])
        manifest = {"schema_version": SCHEMA_VERSION, "step": step, "files": files, "rows": rows}
        rel = f"manifests/step={step}/{key}.json"
        self.write_bytes(self.path(rel), json.dumps(manifest, sort_keys=True).encode())
        return rel

    def manifests(self, steps: Iterable[int] | None = None) -> list[dict[str, Any]]:
        """The committed manifests (with ``steps``: those steps' only), read at once: s3fs fetches a
        list of objects concurrently, where one GET at a time made every read cost a round trip per
        flush the campaign ever made."""
        folders = ["manifests"] if steps is None else [f"manifests/step={int(s)}" for s in sorted(set(steps))]
        # a temporary file left by a crash is not one
        paths = [path for folder in folders for path in self.files_under(folder, ".json")]
        found = []
        for path, data in self.fs.cat(paths).items() if paths else ():
            try:
                found.append(json.loads(data))
            except ValueError as error:
                raise StoreError(f"{self.url(path)}: manifest is not valid JSON ({error})") from None
        return found

    def files_under(self, folder: str, suffix: str) -> list[str]:
        """Paths (full, sorted) of the files under ``folder`` of the campaign whose name ends with
        ``suffix``; none when the folder does not exist."""
        base = self.path(folder)
        if not self.fs.exists(base):
            return []
        return [path for path in sorted(self.fs.find(base)) if path.endswith(suffix)]

    def committed_parts(self, kind: str) -> list[str]:
        """Paths of every part a manifest lists, quarantined or not."""
        return self._listed(self.manifests(), kind)

    def _listed(self, manifests: list[dict[str, Any]], kind: str) -> list[str]:
        return [
            self.path(rel) for rel in sorted({rel for m in manifests for rel in m["files"].get(kind, [])})
        ]

    def visible(self, steps: Iterable[int] | None = None) -> dict[str, list[str]]:
        """Kind -> paths (full, for this filesystem) of the parts that committed manifests list (with
        ``steps``: those steps' manifests), less the ones moved to quarantine (a part written again at
        its path after that is visible again). Manifests and quarantine are read once for every kind."""
        manifests = self.manifests(steps)
        hidden = {(entry["kind"], self.path(entry["part"])) for entry in self.quarantined_parts()}
        return {
            kind: [p for p in self._listed(manifests, kind) if (kind, p) not in hidden or self.exists(p)]
            for kind in KINDS
        }

    def visible_parts(self, kind: str, steps: Iterable[int] | None = None) -> list[str]:
        return self.visible(steps)[kind]

    def steps(self) -> list[int]:
        return sorted({int(m["step"]) for m in self.manifests()})

    def read_table(self, kind: str) -> pa.Table:
        """All visible rows of one dataset as one Arrow table (small datasets and tests)."""
        tables = []
        for path in self.visible_parts(kind):
            try:
                table = pq.read_table(io.BytesIO(self.read_bytes(path)))
            except (OSError, pa.ArrowException) as error:  # pyarrow's message names no file
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise StoreError(
                    f"{self.url(path)}: unreadable {kind} part: {reason}; `gyre traj check --quarantine` "
                    "moves unreadable parts aside so the rest stays readable"
                ) from error
            check_table(table, kind, path)
            tables.append(table.select(SCHEMAS[kind].names).cast(SCHEMAS[kind]))
        if not tables:
            return SCHEMAS[kind].empty_table()
        return pa.concat_tables(tables)

    def read_columns(self, kind: str, columns: list[str], step: int) -> pa.Table:
        """Some columns of one step's visible rows of a dataset (only that step's parts are read)."""
        tables = [
            pq.read_table(io.BytesIO(self.read_bytes(path)), columns=columns)
            for path in self.visible_parts(kind, steps=[step])
        ]
        schema = pa.schema([SCHEMAS[kind].field(c) for c in columns])
        return pa.concat_tables([t.cast(schema) for t in tables]) if tables else schema.empty_table()

    # -- quarantine ----------------------------------------------------------------------------
    def quarantine(self, step: int, entries: list[dict[str, Any]]) -> str | None:
        """Keeps records that failed validation, each with the reason; returns the file written."""
        if not entries:
            return None
        lines = [json.dumps(entry, default=_json_default, sort_keys=True) for entry in entries]
        rel = f"quarantine/step={step}/{ids_key(lines)}.jsonl"
        self.write_bytes(self.path(rel), ("\n".join(lines) + "\n").encode())
        return rel

    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantined records (not parts), each with its reason."""
        entries = []
        for path in self.files_under("quarantine", ".jsonl"):
            entries.extend(json.loads(line) for line in self.read_bytes(path).decode().splitlines() if line)
        return entries

    def quarantined_parts(self) -> list[dict[str, Any]]:
        """The parts moved aside (parts.quarantine_parts): part, kind, reason, moved_to, size."""
        return [json.loads(self.read_bytes(p)) for p in self.files_under(QUARANTINED_PARTS, ".json")]

    def move(self, src: str, dst: str) -> None:
        """Moves an object within the store: a rename locally; a copy, then a delete, elsewhere."""
        if self.is_local:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
        else:
            self.fs.copy(src, dst)
            self.fs.rm_file(src)


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
