"""Workspace snapshots in the store as Parquet rows: taken from a workspace, and written back into a
fresh one for grading with the same refusals as the tar extraction.

    snapshots = SnapshotStore(store)
    uri = store_workspace(snapshots, step, execution_id, workspace, problem_id="p", source="timeout",
                          template_files=problem.files)
    sandbox = sandbox_from_stored(snapshots, uri, fresh_root, secrets.token_hex(8))   # grade here
    data = export_snapshot(snapshots, uri)      # the deterministic tar.gz, = snapshot_bytes(workspace)

``store_workspace`` walks the workspace once (environments/snapshot.py ``bounded_entries``: the
entries the tar would hold, within the limits that ``materialise`` and ``sandbox_from_stored``
check, so a stored snapshot always restores; what did not fit is left out, and the snapshot then
holds a ``TRUNCATED_MARKER`` file listing it) and stores its rows next to the problem's starting workspace (a
``template`` snapshot built from the problem's files, so `gyre sql` can say what changed), contents
by sha256 (trajectory_store/snapshots.py).

``materialise`` trusts no row: each row becomes a tar member and passes ``check_members`` (absolute
paths, ``..``, duplicates, entries below a symlink, symlinks leading outside, devices and fifos,
the byte limit), the row count is bounded, every file's blob must be stored with the size the row
declares, and every blob read must hash to its key; only then is anything written.
"""

from __future__ import annotations

import hashlib
import io
import logging
import tarfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from environments.sandbox import Sandbox, SandboxLimits
from environments.snapshot import (
    MAX_EXTRACT_BYTES,
    MAX_EXTRACT_MEMBERS,
    UnsafeArchive,
    bounded_entries,
    check_members,
    extract_snapshot,
    open_workspace_file,
    read_snapshot,
    tar_from_entries,
    write_members,
)
from trajectory_store.snapshots import ContentReader, SnapshotEntry, SnapshotStore, StoredSnapshot

logger = logging.getLogger(__name__)

TRUNCATED_MARKER = ".gyre-snapshot-truncated"
"""A file a truncated snapshot holds at its root: the paths left out (a dot-file, so no grading
copy takes it)."""
_MARKER_BYTES = 8192
_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    # never written by us; a row that says so is refused as the tar member would be
    "chardev": tarfile.CHRTYPE,
    "blockdev": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
}


# -- writing --------------------------------------------------------------------------------------
def template_entries(files: Mapping[str, str | bytes]) -> tuple[list[SnapshotEntry], ContentReader]:
    """A problem's starting workspace as entries (what ``workspace_entries`` gives for a workspace
    just created from these files: folders 0o755, files 0o644) and a reader of their contents."""
    entries: dict[str, SnapshotEntry] = {}
    contents: dict[str, bytes] = {}
    for rel, content in files.items():
        data = content.encode() if isinstance(content, str) else bytes(content)
        parts = [p for p in PurePosixPath(rel).parts if p != "."]
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            entries.setdefault(folder, SnapshotEntry(folder, "dir", 0o755))
        sha = hashlib.sha256(data).hexdigest()
        path = "/".join(parts)
        entries[path] = SnapshotEntry(path, "file", 0o644, len(data), sha)
        contents[sha] = data
    return sorted(entries.values(), key=lambda e: e.path), lambda entry: contents[entry.sha256]


def store_workspace(
    snapshots: SnapshotStore,
    step: int,
    execution_id: str,
    workspace: str | Path,
    *,
    problem_id: str | None,
    source: str = "timeout",
    template_files: Mapping[str, str | bytes] | None = None,
    max_bytes: int = MAX_EXTRACT_BYTES,
    max_members: int = MAX_EXTRACT_MEMBERS,
) -> str:
    """Stores the workspace's snapshot (and the problem's template, when given); returns its URI.

    The snapshot holds what fits ``max_bytes`` and ``max_members`` (the limits its restore checks);
    what does not is left out, logged, and listed in a ``TRUNCATED_MARKER`` file of the snapshot."""
    root = Path(workspace).resolve()
    entries, skipped = bounded_entries(root, max_bytes - _MARKER_BYTES, max_members - 1)
    marker = b""
    if skipped:
        logger.warning(
            "execution %s: its snapshot left out %d paths (limits %d bytes / %d entries; first: %s)",
            execution_id, len(skipped), max_bytes, max_members, skipped[0],
        )  # fmt: skip
        listing = f"{len(skipped)} paths left out of this snapshot (each with why):\n"
        marker = (listing + "".join(f"{rel}\n" for rel in skipped)).encode()[:_MARKER_BYTES]
        entries = [e for e in entries if e.path != TRUNCATED_MARKER]
        sha = hashlib.sha256(marker).hexdigest()
        entries.append(SnapshotEntry(TRUNCATED_MARKER, "file", 0o644, len(marker), sha))
        entries.sort(key=lambda e: e.path)

    def content(entry: SnapshotEntry) -> bytes:
        if skipped and entry.path == TRUNCATED_MARKER:
            return marker
        with open_workspace_file(root / entry.path) as handle:
            return handle.read(entry.size)

    template = template_entries(template_files) if template_files is not None else None
    return snapshots.write(
        step,
        entries,
        content,
        execution_id=execution_id,
        problem_id=problem_id,
        source=source,
        template=template,
    )


# -- reading back ---------------------------------------------------------------------------------
class BlobSource:
    """The blobs a restore writes, one part in memory at a time: writing files in the order of
    ``rank`` reads each part once; ``get`` serves a blob from the part read last (reading its part,
    and checking its hash again, when it is another). ``peak_bytes``: the most blob bytes it held."""

    def __init__(self, snapshots: SnapshotStore, shas: set[str]) -> None:
        self.snapshots = snapshots
        self.parts = snapshots.blob_parts(shas)
        self.part_of = {sha: path for path, wanted in self.parts.items() for sha in wanted}
        self._rank = {path: i for i, path in enumerate(self.parts)}
        self._path: str | None = None
        self._blobs: dict[str, bytes] = {}
        self.peak_bytes = 0

    def rank(self, sha: str | None) -> int:
        """Position of the blob's part in reading order (-1: no blob)."""
        return -1 if sha is None else self._rank[self.part_of[sha]]

    def get(self, sha: str) -> bytes:
        path = self.part_of[sha]
        if path != self._path:
            self._blobs = {}  # the previous part goes before the next one is read
            self._blobs = self.snapshots.part_blobs(path, self.parts[path])
            for key, data in self._blobs.items():  # checked before any write; again, as written
                if hashlib.sha256(data).hexdigest() != key:
                    raise UnsafeArchive(f"blob {key}: its bytes changed since they were checked")
            self._path = path
            self.peak_bytes = max(self.peak_bytes, sum(len(data) for data in self._blobs.values()))
        return self._blobs[sha]


def checked_contents(
    snapshots: SnapshotStore,
    entries: list[SnapshotEntry],
    max_bytes: int = MAX_EXTRACT_BYTES,
    max_members: int = MAX_EXTRACT_MEMBERS,
) -> tuple[list[tarfile.TarInfo], list[str], BlobSource]:
    """Checks a snapshot's rows as ``extract_snapshot`` checks a tar's members, then reads and
    verifies their blobs, one part at a time (none is kept): (members, cleaned names, the source the
    writing reads them from again). Raises ``UnsafeArchive``."""
    if len(entries) > max_members:
        raise UnsafeArchive(f"the snapshot holds more than {max_members} entries")
    members = [_member(e) for e in entries]
    names = check_members(members, max_bytes)
    files = [e for e in entries if e.kind == "file"]
    index = snapshots.blob_index()
    for e in files:
        if not isinstance(e.sha256, str) or e.sha256 not in index:
            raise UnsafeArchive(f"entry {e.path!r}: its content ({e.sha256}) is not in the store's blobs")
        if index[e.sha256][1] != e.size:
            raise UnsafeArchive(
                f"entry {e.path!r}: declares {e.size} bytes, its blob holds {index[e.sha256][1]}"
            )
    sizes = {e.sha256: e.size for e in files}
    read: set[str] = set()
    for sha, data in snapshots.iter_blobs(sizes):
        if hashlib.sha256(data).hexdigest() != sha:
            raise UnsafeArchive(f"blob {sha}: its bytes do not hash to its key")
        if len(data) != sizes[sha]:
            raise UnsafeArchive(f"blob {sha}: holds {len(data)} bytes, its entries declare {sizes[sha]}")
        read.add(sha)
    for e in files:
        if e.sha256 not in read:
            raise UnsafeArchive(f"entry {e.path!r}: its blob could not be read whole")
    return members, names, BlobSource(snapshots, set(sizes))


def _write_from(
    entries: list[SnapshotEntry],
    members: list[tarfile.TarInfo],
    names: list[str],
    source: BlobSource,
    dest: Path,
) -> list[str]:
    """write_members with the files in their blobs' part order, so each part is read once."""
    sha_of = {e.path: e.sha256 for e in entries if e.kind == "file"}
    order = sorted(range(len(members)), key=lambda i: source.rank(sha_of.get(members[i].name)))
    return write_members(
        [members[i] for i in order],
        [names[i] for i in order],
        dest,
        lambda member: io.BytesIO(source.get(sha_of[member.name])),
    )


def _member(entry: SnapshotEntry) -> tarfile.TarInfo:
    if not isinstance(entry.path, str):
        raise UnsafeArchive(f"entry {entry.path!r}: no path")
    if entry.kind not in _TYPES:
        raise UnsafeArchive(f"entry {entry.path!r}: unsupported kind {entry.kind!r}")
    if not isinstance(entry.mode, int) or not isinstance(entry.size, int) or entry.size < 0:
        raise UnsafeArchive(
            f"entry {entry.path!r}: mode {entry.mode!r} and size {entry.size!r} must be numbers"
        )
    if entry.kind != "file" and entry.size:
        raise UnsafeArchive(f"entry {entry.path!r}: a {entry.kind} with a size")
    info = tarfile.TarInfo(entry.path)
    info.type = _TYPES[entry.kind]
    info.mode = entry.mode
    info.size = entry.size if entry.kind == "file" else 0
    info.linkname = entry.link_target or ""
    return info


def materialise(
    snapshots: SnapshotStore,
    entries: list[SnapshotEntry],
    dest: str | Path,
    max_bytes: int = MAX_EXTRACT_BYTES,
    max_members: int = MAX_EXTRACT_MEMBERS,
) -> list[str]:
    """Writes a snapshot's entries into ``dest`` (missing or empty) after every check passed;
    returns the files and links written, sorted. Raises ``UnsafeArchive`` and writes nothing when a
    row, a limit or a blob fails."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"materialise into a fresh folder: {dest} is not empty")
    members, names, source = checked_contents(snapshots, entries, max_bytes, max_members)
    return _write_from(entries, members, names, source, dest.resolve() if dest.exists() else dest)


def sandbox_from_stored(
    snapshots: SnapshotStore,
    uri: str,
    root: str | Path,
    name: str,
    limits: SandboxLimits | None = None,
    max_bytes: int = MAX_EXTRACT_BYTES,
    max_members: int = MAX_EXTRACT_MEMBERS,
) -> Sandbox:
    """A fresh sandbox ``root/name`` holding the stored snapshot's files (for grading a timeout).

    A URI of the first format (``….tar.gz``) is read and extracted as a tar."""
    if uri.endswith(".tar.gz"):
        data = read_snapshot(snapshots.store, uri)
        sandbox = Sandbox.create(root, name, limits=limits)
        extract_snapshot(data, sandbox.workspace, max_bytes, max_members)
        return sandbox
    stored = snapshots.read(uri)
    members, names, source = checked_contents(snapshots, stored.entries, max_bytes, max_members)
    sandbox = Sandbox.create(root, name, limits=limits)
    _write_from(stored.entries, members, names, source, sandbox.workspace)
    return sandbox


def export_snapshot(
    snapshots: SnapshotStore,
    uri: str,
    max_bytes: int = MAX_EXTRACT_BYTES,
    max_members: int = MAX_EXTRACT_MEMBERS,
) -> bytes:
    """The deterministic tar.gz of a stored snapshot (checked first, as for grading: an exported
    tar is always safe to extract); a snapshot of the first format is returned as stored."""
    if uri.endswith(".tar.gz"):
        return read_snapshot(snapshots.store, uri)
    stored: StoredSnapshot = snapshots.read(uri)
    checked_contents(snapshots, stored.entries, max_bytes, max_members)
    blobs = snapshots.read_blobs(
        {e.sha256 for e in stored.entries if e.kind == "file"}
    )  # the tar is in memory anyway
    return tar_from_entries(stored.entries, lambda e: io.BytesIO(blobs[e.sha256]))
