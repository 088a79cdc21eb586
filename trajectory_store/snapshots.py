"""Workspace snapshots as Parquet: one row per entry in ``snapshots``, contents stored once in ``blobs``.

    snapshots = SnapshotStore(store)          # one per dispatcher: it remembers which blobs are stored
    uri = snapshots.write(step, entries, read_content, execution_id="s0-p-g1", problem_id="p",
                          source="timeout", template=(template_entries, read_template_content))
    stored = snapshots.read(uri)              # StoredSnapshot: its ids and its entries
    data = snapshots.read_blobs({e.sha256 for e in stored.entries if e.kind == "file"})

Layout (storage.py): ``snapshots/step=<n>/part-<key>.parquet`` holds ONE snapshot (one execution's,
or one problem's starting workspace, ``source = 'template'``), key = ids_key(owner, snapshot_id);
``blobs/step=<n>/part-<key>.parquet`` holds the contents that were not stored yet when the snapshot
was written (sha256, size, bytes; parts of at most ``blob_part_bytes``), key = ids_key(their
sha256s). One manifest per write lists the snapshot part, its template's part and the new blob
parts, so a snapshot becomes visible whole, with every blob it references. A group of executions of
one problem, and unchanged files from step to step, share their blobs; the rows stay per snapshot.

Idempotent: the same entries give the same snapshot_id, the same keys and the same bytes (a retry
writes nothing new); a re-run execution whose workspace differs gets a second part, and the
``snapshots`` view keeps the one its executions row names (sql/07_snapshots.sql).

What this module does not do: walk a workspace or write one back. environments/snapshot.py does
both, and refuses unsafe entries (absolute paths, ``..``, links out, devices, limits) with the
same checks as its tar extraction; this module only refuses to *store* malformed entries.
"""

from __future__ import annotations

import hashlib
import io
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from trajectory_store.schema import (
    BLOBS_SCHEMA,
    ENTRY_KINDS,
    SCHEMA_VERSION,
    SNAPSHOT_SOURCES,
    SNAPSHOTS_SCHEMA,
    RecordError,
    check_table,
)
from trajectory_store.storage import Store, StoreError, ids_key

BLOB_PART_BYTES = 64 << 20
"""Contents per blobs part (a larger file gets a part of its own)."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class SnapshotEntry:
    """One file, folder or symlink of a workspace, as a snapshots row holds it."""

    path: str
    """relative, '/'-separated"""
    kind: str
    """file, dir or symlink (a row read back may say anything: readers check)"""
    mode: int
    """0o644 or 0o755 for files, 0o755 for folders, 0o777 for links"""
    size: int = 0
    """bytes of a file; 0 otherwise"""
    sha256: str | None = None
    """hex sha256 of a file's bytes (its key in blobs)"""
    link_target: str | None = None
    """a symlink's target, relative to the link's folder"""


@dataclass(frozen=True)
class StoredSnapshot:
    """One snapshot read back from the store."""

    uri: str
    snapshot_id: str
    execution_id: str | None
    problem_id: str | None
    step: int
    source: str
    template_id: str | None
    entries: list[SnapshotEntry]


ContentReader = Callable[[SnapshotEntry], bytes]
"""Gives a file entry's bytes (the writer checks them against the entry's sha256 and size)."""


def snapshot_id(entries: Iterable[SnapshotEntry]) -> str:
    """The digest of a tree: sha256 over its entries sorted by path (whose snapshot it is aside)."""
    digest = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.path):
        fields = (e.path, e.kind, oct(e.mode), str(e.size), e.sha256 or "", e.link_target or "")
        digest.update("\x00".join(fields).encode())
        digest.update(b"\x01")
    return digest.hexdigest()


def check_entries(entries: list[SnapshotEntry], owner: str) -> None:
    """Refuses (RecordError) entries that must never be stored: a bad path, kind or content key."""
    seen: set[str] = set()
    for e in entries:
        parts = e.path.split("/")
        if (
            not e.path
            or e.path.startswith("/")
            or "\x00" in e.path
            or "\\" in e.path
            or any(p in ("", ".", "..") for p in parts)
        ):
            raise RecordError(f"snapshot entry path {e.path!r} is not a clean relative path", field=owner)
        if e.path in seen:
            raise RecordError(f"snapshot entry {e.path!r} appears twice", field=owner)
        seen.add(e.path)
        if e.kind not in ENTRY_KINDS:
            raise RecordError(
                f"snapshot entry {e.path!r}: kind {e.kind!r} is not one of {ENTRY_KINDS}", field=owner
            )
        if e.kind == "file" and (not e.sha256 or not _SHA256.match(e.sha256) or e.size < 0):
            raise RecordError(f"snapshot entry {e.path!r}: a file needs its sha256 and size", field=owner)
        if e.kind == "symlink" and not e.link_target:
            raise RecordError(f"snapshot entry {e.path!r}: a symlink needs its target", field=owner)


class SnapshotStore:
    """Writes and reads one campaign's snapshots. Thread-safe; keeps an index of the stored blobs
    (sha256 -> part, size), read from the store once and kept up to date by its own writes, so a
    group's executions store their shared files once. Blobs written by another process after the
    index was read are not known: such a file is stored again (a duplicate the views drop), never
    left out."""

    def __init__(self, store: Store, blob_part_bytes: int = BLOB_PART_BYTES):
        self.store = store
        self.blob_part_bytes = blob_part_bytes
        self._lock = threading.RLock()
        self._blobs: dict[str, tuple[str, int]] | None = None
        self._committed: set[str] = set()  # snapshot parts committed (read with the blob index)

    # -- blobs -------------------------------------------------------------------------------
    def blob_index(self) -> dict[str, tuple[str, int]]:
        """sha256 -> (path of a committed blobs part holding it, size)."""
        with self._lock:
            if self._blobs is None:
                self._committed = set(self.store.visible_parts("snapshots"))
                index: dict[str, tuple[str, int]] = {}
                for path in self.store.visible_parts("blobs"):
                    table = self._read_parquet(path, columns=["sha256", "size"])
                    for sha, size in zip(
                        table.column("sha256").to_pylist(), table.column("size").to_pylist(), strict=True
                    ):
                        index.setdefault(sha, (path, size))
                self._blobs = index
            return self._blobs

    def read_blobs(self, shas: Iterable[str]) -> dict[str, bytes]:
        """The stored bytes of these blobs (a sha256 the store lacks is absent from the result)."""
        return dict(self.iter_blobs(shas))

    def blob_parts(self, shas: Iterable[str]) -> dict[str, list[str]]:
        """The blobs' parts (sorted) and, per part, the wanted sha256s it holds (unknown ones left out)."""
        index = self.blob_index()
        by_part: dict[str, list[str]] = {}
        for sha in sorted(set(shas)):
            if sha in index:
                by_part.setdefault(index[sha][0], []).append(sha)
        return dict(sorted(by_part.items()))

    def part_blobs(self, path: str, wanted: list[str]) -> dict[str, bytes]:
        """The wanted blobs of one part: at most one part's contents in memory."""
        table = self._read_parquet(path, columns=["sha256", "data"], filters=[("sha256", "in", wanted)])
        return dict(zip(table.column("sha256").to_pylist(), table.column("data").to_pylist(), strict=True))

    def iter_blobs(self, shas: Iterable[str]) -> Iterator[tuple[str, bytes]]:
        """(sha256, bytes) of these blobs, one part read at a time (a sha256 the store lacks is skipped)."""
        for path, wanted in self.blob_parts(shas).items():
            yield from self.part_blobs(path, wanted).items()

    def _read_parquet(self, path: str, columns: list[str], filters=None) -> pa.Table:
        try:
            with self.store.fs.open(path, "rb") as handle:
                return pq.read_table(handle, columns=columns, filters=filters)
        except (OSError, pa.ArrowException) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise StoreError(
                f"{self.store.url(path)}: unreadable part: {reason}; `gyre traj check --quarantine` "
                "moves unreadable parts aside"
            ) from error

    # -- writing -----------------------------------------------------------------------------
    def write(
        self,
        step: int,
        entries: list[SnapshotEntry],
        content: ContentReader,
        *,
        execution_id: str | None,
        problem_id: str | None,
        source: str,
        template: tuple[list[SnapshotEntry], ContentReader] | None = None,
    ) -> str:
        """Stores one snapshot (and its template, when given) and returns the URI ``read`` takes.

        Blobs the store lacks are written first, then the snapshot's part (and the template's), then
        the manifest that makes them visible together. Raises RecordError for malformed entries or
        content that does not match its entry (a file changed while it was read)."""
        if source not in SNAPSHOT_SOURCES:
            raise RecordError(f"unknown snapshot source {source!r} (expected one of {SNAPSHOT_SOURCES})")
        if (execution_id is None) != (source == "template"):
            raise RecordError("a template snapshot has no execution_id; every other snapshot has one")
        owner = execution_id or f"template:{problem_id}"
        check_entries(entries, owner)
        tree_id = snapshot_id(entries)
        template_id = None
        readers = [(entries, content)]
        if template is not None:
            check_entries(template[0], f"template:{problem_id}")
            template_id = snapshot_id(template[0])
            readers.append(template)
        rel = _part(step, owner, tree_id)
        uri = self.store.url(self.store.path(rel))
        with self._lock:
            self.blob_index()  # loads what is committed
            wanted = [rel] + ([_part(step, f"template:{problem_id}", template_id)] if template else [])
            if all(self.store.path(r) in self._committed for r in wanted):
                return uri  # written and committed before (a retry): nothing new to write
            parts: dict[str, list[str]] = {"snapshots": [], "blobs": []}
            rows = {"snapshots": 0, "blobs": 0}
            new_blobs = self._write_blobs(step, readers, parts, rows)
            if template is not None:
                parts["snapshots"].append(
                    self._write_rows(step, template[0], None, problem_id, "template", template_id, None)
                )
                rows["snapshots"] += len(template[0])
            parts["snapshots"].append(
                self._write_rows(step, entries, execution_id, problem_id, source, tree_id, template_id)
            )
            rows["snapshots"] += len(entries)
            self.store.commit(step, parts, rows)
            self.blob_index().update(new_blobs)
            self._committed.update(self.store.path(r) for r in parts["snapshots"])
            return uri

    def _write_blobs(
        self,
        step: int,
        readers: list[tuple[list[SnapshotEntry], ContentReader]],
        parts: dict[str, list[str]],
        rows: dict[str, int],
    ) -> dict[str, tuple[str, int]]:
        known = self.blob_index()
        missing: dict[str, tuple[SnapshotEntry, ContentReader]] = {}
        for entries, reader in readers:
            for e in entries:
                if e.kind == "file" and e.sha256 not in known:
                    missing.setdefault(e.sha256, (e, reader))
        written: dict[str, tuple[str, int]] = {}
        batch: list[tuple[str, bytes]] = []
        batch_bytes = 0

        def flush() -> None:
            nonlocal batch, batch_bytes
            if not batch:
                return
            table = pa.table(
                {
                    "sha256": [sha for sha, _ in batch],
                    "size": [len(data) for _, data in batch],
                    "data": pa.array([data for _, data in batch], pa.large_binary()),
                    "schema_version": [SCHEMA_VERSION] * len(batch),
                },
                schema=BLOBS_SCHEMA,
            )
            rel = self.store.write_part("blobs", step, table, ids_key(["blobs"], [sha for sha, _ in batch]))
            parts["blobs"].append(rel)
            rows["blobs"] += len(batch)
            for sha, data in batch:
                written[sha] = (self.store.path(rel), len(data))
            batch, batch_bytes = [], 0

        for sha in sorted(missing):
            entry, reader = missing[sha]
            data = reader(entry)
            if len(data) != entry.size or hashlib.sha256(data).hexdigest() != sha:
                raise RecordError(
                    f"snapshot entry {entry.path!r}: its content does not match its size and sha256 "
                    "(it changed while the snapshot was taken)"
                )
            if batch and batch_bytes + len(data) > self.blob_part_bytes:
                flush()
            batch.append((sha, data))
            batch_bytes += len(data)
        flush()
        return written

    def _write_rows(
        self,
        step: int,
        entries: list[SnapshotEntry],
        execution_id: str | None,
        problem_id: str | None,
        source: str,
        tree_id: str,
        template_id: str | None,
    ) -> str:
        owner = execution_id if execution_id is not None else f"template:{problem_id}"
        rel = _part(step, owner, tree_id)
        if self.store.path(rel) in self._committed:
            return rel  # committed already (a template shared by a group): listing it again is enough
        ordered = sorted(entries, key=lambda e: e.path)
        n = len(ordered)
        table = pa.table(
            {
                "snapshot_id": [tree_id] * n,
                "execution_id": [execution_id] * n,
                "problem_id": [problem_id] * n,
                "step": [step] * n,
                "source": [source] * n,
                "template_id": [template_id] * n,
                "path": [e.path for e in ordered],
                "kind": [e.kind for e in ordered],
                "mode": [e.mode for e in ordered],
                "size": [e.size for e in ordered],
                "sha256": [e.sha256 for e in ordered],
                "link_target": [e.link_target for e in ordered],
                "schema_version": [SCHEMA_VERSION] * n,
            },
            schema=SNAPSHOTS_SCHEMA,
        )
        return self.store.write_part("snapshots", step, table, ids_key([owner, tree_id]))

    # -- reading -----------------------------------------------------------------------------
    def read(self, uri: str) -> StoredSnapshot:
        """The snapshot a URI from ``write`` names (one part, one snapshot)."""
        path = uri.split("://", 1)[1] if "://" in uri else uri
        if not self.store.exists(path):
            raise StoreError(f"{uri}: no such snapshot")
        try:
            table = pq.read_table(io.BytesIO(self.store.read_bytes(path)))
        except (OSError, pa.ArrowException) as error:
            raise StoreError(f"{uri}: unreadable snapshot part: {str(error).splitlines()[0]}") from error
        check_table(table, "snapshots", uri)
        rows = table.select(SNAPSHOTS_SCHEMA.names).to_pylist()
        heads = {
            (r["snapshot_id"], r["execution_id"], r["problem_id"], r["step"], r["source"], r["template_id"])
            for r in rows
        }
        if len(heads) > 1:
            raise StoreError(f"{uri}: a snapshot part must hold one snapshot, this one holds {len(heads)}")
        entries = [
            SnapshotEntry(r["path"], r["kind"], r["mode"], r["size"], r["sha256"], r["link_target"])
            for r in sorted(rows, key=lambda r: (r["path"] is None, r["path"] or ""))
        ]
        if not heads:  # an empty workspace
            return StoredSnapshot(uri, snapshot_id([]), None, None, 0, "timeout", None, [])
        tree, execution_id, problem_id, step, source, template_id = heads.pop()
        return StoredSnapshot(uri, tree, execution_id, problem_id, step, source, template_id, entries)

    def find(self, execution_id: str) -> str | None:
        """The URI of an execution's snapshot: the one its executions row names, else its latest
        stored one (a snapshot whose execution was never finished); None when there is none."""
        executions = self.store.read_table("executions").to_pylist()
        mine = [e for e in executions if e["execution_id"] == execution_id and e["snapshot_uri"]]
        if mine:
            latest = max(mine, key=lambda e: (e["step"], e["ended_at"] or 0.0))
            return latest["snapshot_uri"]
        best: tuple[int, str] | None = None
        for path in self.store.visible_parts("snapshots"):
            table = self._read_parquet(path, columns=["execution_id", "step"])
            steps = [
                s
                for e, s in zip(
                    table.column("execution_id").to_pylist(), table.column("step").to_pylist(), strict=True
                )
                if e == execution_id
            ]
            if steps and (best is None or (max(steps), path) > best):
                best = (max(steps), path)
        return self.store.url(best[1]) if best else None


def _part(step: int, owner: str, tree_id: str) -> str:
    """Where one snapshot's rows go: derived from whose snapshot it is and its tree, nothing else."""
    return f"snapshots/step={step}/part-{ids_key([owner, tree_id])}.parquet"
