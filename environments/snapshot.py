"""Workspace snapshots: what a workspace holds (``workspace_entries``), as a deterministic tar.gz
(``snapshot_bytes``, ``tar_from_entries``), and the safe way back to files (``extract_snapshot``).

The store keeps snapshots as Parquet rows (environments/snapshot_rows.py over
trajectory_store/snapshots.py); the tar.gz is what ``gyre snapshot export`` writes, and the first
format: a campaign written before the rows may still hold ``snapshots/<execution_id>.tar.gz``
(``write_snapshot``, ``read_snapshot``, ``sandbox_from_snapshot`` read and write those).

Both formats hold the same entries, from one walk: sorted by path; folders (mode 0o755), files
(0o755 if executable, else 0o644; hard links become plain files) and symlinks (kept, as relative
links, only when they stay inside the workspace); sockets, fifos and devices are left out.
``bounded_entries`` is the walk within a byte and an entry limit: the store takes a snapshot within
the limits its extraction checks (``MAX_EXTRACT_BYTES``, ``MAX_EXTRACT_MEMBERS``), so whatever a
workspace holds (hard links to one large file count once per link), its snapshot can be restored. The tar
adds mtime 0, uid/gid 0, empty owner names and gzip header mtime 0, so the same tree gives the same
bytes whatever its timestamps, and the tar exported from a snapshot's rows is the tar of the
workspace it was taken from.

Extraction trusts nothing: every member is checked before anything is written. Absolute names,
``..`` components, duplicate names, members below a symlink, symlinks whose target (followed
through the archive's other links) leaves the destination, hard links to anything but an earlier
regular file of the archive, devices, fifos and unknown types raise ``UnsafeArchive``. Rows read
back from the store are turned into the same members and pass the same checks (``check_members``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import tarfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from environments.sandbox import Sandbox, SandboxLimits
from environments.workspace_tree import Found, link_inside, printable, walk
from trajectory_store.snapshots import SnapshotEntry
from trajectory_store.storage import Store

MAX_LINK_HOPS = 40
EXECUTION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")


class UnsafeArchive(ValueError):
    """A snapshot member that extraction refuses: the message names the member and the reason."""


# -- packing ------------------------------------------------------------------------------------
def workspace_entries(workspace: str | Path) -> list[SnapshotEntry]:
    """The workspace's entries, sorted by path, each file with its size and sha256 (read once,
    streamed: a large workspace is never held whole). See the module docstring for what is kept."""
    return bounded_entries(workspace)[0]


def bounded_entries(
    workspace: str | Path, max_bytes: int | None = None, max_members: int | None = None
) -> tuple[list[SnapshotEntry], list[str]]:
    """``workspace_entries`` within limits: (the entries, the paths left out, each with why). Each
    path's bytes count against ``max_bytes`` (hard links to one file count once per link, as
    extraction writes them), so a file that would pass it, and every entry past ``max_members``, is
    left out unread. The walk (environments/workspace_tree.py) never raises for what the workspace
    holds: names no store keeps, folders too deep, links out or in a loop are left out too."""
    root = os.path.realpath(workspace)
    skipped: list[str] = []

    def leave_out(rel: str, why: str) -> None:
        skipped.append(f"{printable(rel)} ({why})")

    found = sorted(walk(root, leave_out, max_entries=max_members), key=lambda f: f.rel)
    entries: list[SnapshotEntry] = []
    total = 0
    for item in found:
        if max_bytes is not None and item.is_file and total + item.info.st_size > max_bytes:
            leave_out(item.rel, "the byte limit")
            continue
        entry = _entry(root, item, leave_out)
        if entry is None:
            continue
        if entry.kind == "file" and max_bytes is not None and total + entry.size > max_bytes:
            leave_out(item.rel, "the byte limit: it grew after its size was read")
            continue
        total += entry.size
        entries.append(entry)
    return entries, skipped


def _entry(root: str, item: Found, leave_out: Callable[[str, str], None]) -> SnapshotEntry | None:
    if item.is_link:
        target = link_inside(root, item.path)
        if target is None:
            return None  # a link out of the workspace (or in a loop) is not part of it
        return SnapshotEntry(item.rel, "symlink", 0o777, link_target=target)
    if item.is_dir:
        return SnapshotEntry(item.rel, "dir", 0o755)
    if item.is_file:
        digest, size = hashlib.sha256(), 0
        try:
            with open_workspace_file(Path(item.path)) as handle:
                mode = 0o755 if os.fstat(handle.fileno()).st_mode & 0o111 else 0o644
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            leave_out(item.rel, f"a file that cannot be read ({exc.strerror})")
            return None
        return SnapshotEntry(item.rel, "file", mode, size, digest.hexdigest())
    return None  # sockets, fifos, devices


def open_workspace_file(path: Path) -> BinaryIO:
    """Opens a workspace file for reading without following a link put in its place."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb")


def snapshot_bytes(workspace: str | Path) -> bytes:
    """The workspace as a deterministic tar.gz (see the module docstring for what is kept)."""
    root = Path(workspace).resolve()
    return tar_from_entries(workspace_entries(root), lambda entry: open_workspace_file(root / entry.path))


def tar_from_entries(entries: list[SnapshotEntry], open_file: Callable[[SnapshotEntry], BinaryIO]) -> bytes:
    """The deterministic tar.gz of these entries; ``open_file`` gives a file entry's bytes (exactly
    ``entry.size`` of them are stored)."""
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for entry in sorted(entries, key=lambda e: e.path):
            info = _tar_info(entry)
            if info.isreg():
                with open_file(entry) as handle:
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def _tar_info(entry: SnapshotEntry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(entry.path)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.kind == "symlink":
        info.type = tarfile.SYMTYPE
        info.linkname = entry.link_target or ""
        info.mode = 0o777
    elif entry.kind == "dir":
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    elif entry.kind == "file":
        info.type = tarfile.REGTYPE
        info.mode = 0o755 if entry.mode & 0o111 else 0o644
        info.size = entry.size
    else:
        raise UnsafeArchive(f"entry {entry.path!r}: unsupported kind {entry.kind!r}")
    return info


# -- storage ------------------------------------------------------------------------------------
def snapshot_key(store: Store, execution_id: str) -> str:
    """Where an execution's snapshot lives in the store: ``snapshots/<execution_id>.tar.gz``."""
    if not EXECUTION_ID.match(execution_id) or ".." in execution_id:
        raise ValueError(f"execution id {execution_id!r} cannot name an object (letters, digits, ._=- only)")
    return store.path("snapshots", f"{execution_id}.tar.gz")


def write_snapshot(store: Store, execution_id: str, data: bytes) -> str:
    """Writes ``snapshots/<execution_id>.tar.gz`` whole (``Store.write_bytes``: a temporary name and
    a rename on a local disk, one PUT on S3, so a retry rewrites the same bytes) and returns the URI
    that ``read_snapshot`` takes."""
    key = snapshot_key(store, execution_id)
    store.write_bytes(key, data)
    return store.url(key)


def read_snapshot(store: Store, uri: str) -> bytes:
    """The bytes of a snapshot written by ``write_snapshot`` (``uri`` as it returned)."""
    return store.read_bytes(uri.split("://", 1)[1] if "://" in uri else uri)


# -- safe extraction ----------------------------------------------------------------------------
MAX_EXTRACT_BYTES = 1 << 30
"""Default bound on what a snapshot may unpack to (a 1 MB archive can hold 1 GiB of zeros)."""
MAX_EXTRACT_MEMBERS = 50_000
"""Default bound on a snapshot's files, folders and links."""


def extract_snapshot(
    data: bytes, dest: str | Path, max_bytes: int = MAX_EXTRACT_BYTES, max_members: int = MAX_EXTRACT_MEMBERS
) -> list[str]:
    """Unpacks a snapshot into ``dest`` (missing or empty). Every member is checked first; the
    first unsafe one, or more than ``max_members`` members or ``max_bytes`` bytes in all, raises
    ``UnsafeArchive`` and nothing is written. Returns the relative paths of the files and links
    written, sorted."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"extract into a fresh folder: {dest} is not empty")
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = []
            for member in tar:  # counted while reading: 100,000 empty files never all load
                members.append(member)
                if len(members) > max_members:
                    raise UnsafeArchive(f"the archive holds more than {max_members} members")
            names = check_members(members, max_bytes)
            return write_members(members, names, dest.resolve() if dest.exists() else dest, tar.extractfile)
    except (tarfile.TarError, EOFError, gzip.BadGzipFile) as exc:
        raise UnsafeArchive(f"not a readable tar.gz: {exc}") from exc


def _clean_name(member: tarfile.TarInfo) -> str:
    name = member.name
    if "\x00" in name or "\\" in name:
        raise UnsafeArchive(f"member {name!r}: NUL or backslash in the name")
    if name.startswith("/"):
        raise UnsafeArchive(f"member {name!r}: absolute path")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if ".." in parts:
        raise UnsafeArchive(f"member {name!r}: '..' component")
    return "/".join(parts)


def check_members(members: list[tarfile.TarInfo], max_bytes: int) -> list[str]:
    """Refuses (``UnsafeArchive``, naming the member) the first unsafe member, or more than
    ``max_bytes`` bytes of files in all; returns the members' cleaned names."""
    names = [_clean_name(m) for m in members]
    links = {name: m.linkname for name, m in zip(names, members, strict=True) if m.issym()}
    regular: set[str] = set()
    seen: set[str] = set()
    total = 0
    for name, member in zip(names, members, strict=True):
        if name in seen:
            raise UnsafeArchive(f"member {member.name!r}: duplicate name")
        seen.add(name)
        parts = name.split("/") if name else []
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in links:
                raise UnsafeArchive(
                    f"member {member.name!r}: lies below the symlink {'/'.join(parts[:depth])!r}"
                )
        if member.isreg():
            total += member.size
            regular.add(name)
        elif member.isdir():
            pass
        elif member.issym():
            if member.linkname.startswith("/"):
                raise UnsafeArchive(
                    f"member {member.name!r}: symlink to the absolute path {member.linkname!r}"
                )
            _resolve_inside(member.name, parts[:-1], member.linkname, links)
        elif member.islnk():
            try:
                target = _clean_name(tarfile.TarInfo(member.linkname))
            except UnsafeArchive as exc:
                raise UnsafeArchive(
                    f"member {member.name!r}: hard link to {member.linkname!r}: {exc}"
                ) from None
            if target not in regular:
                raise UnsafeArchive(
                    f"member {member.name!r}: hard link to {member.linkname!r}, which is not an earlier "
                    "regular file of the archive"
                )
        elif member.ischr() or member.isblk() or member.isfifo():
            raise UnsafeArchive(f"member {member.name!r}: device or fifo")
        else:
            raise UnsafeArchive(f"member {member.name!r}: unsupported type {member.type!r}")
        if total > max_bytes:
            raise UnsafeArchive(f"member {member.name!r}: archive unpacks to more than {max_bytes} bytes")
    return names


def _resolve_inside(
    member: str, base: list[str], target: str, links: dict[str, str], hops: int = 0
) -> list[str]:
    """Follows ``target`` from the folder ``base`` through the archive's symlinks; raises if it ever
    climbs above the destination."""
    stack = list(base)
    for part in PurePosixPath(target).parts:
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                raise UnsafeArchive(f"member {member!r}: symlink leads outside the destination ({target!r})")
            stack.pop()
            continue
        here = "/".join([*stack, part])
        if here in links:
            if hops >= MAX_LINK_HOPS:
                raise UnsafeArchive(f"member {member!r}: symlink loop")
            if links[here].startswith("/"):
                raise UnsafeArchive(f"member {member!r}: symlink chain reaches an absolute path")
            stack = _resolve_inside(member, stack, links[here], links, hops + 1)
        else:
            stack.append(part)
    return stack


def write_members(
    members: list[tarfile.TarInfo],
    names: list[str],
    dest: Path,
    open_member: Callable[[tarfile.TarInfo], BinaryIO],
) -> list[str]:
    """Writes members that ``check_members`` passed (``names`` as it returned them) under ``dest``:
    folders, then files (O_EXCL, O_NOFOLLOW; bytes from ``open_member``), links last, so nothing is
    ever written through a link. Returns the files and links written, sorted."""
    dest.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    later: list[tuple[str, tarfile.TarInfo]] = []
    for name, member in zip(names, members, strict=True):
        if not name:
            continue
        path = dest / name
        if member.isdir():
            path.mkdir(parents=True, exist_ok=True)
        elif member.isreg():
            path.parent.mkdir(parents=True, exist_ok=True)
            source = open_member(member)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as handle:
                while chunk := source.read(1 << 20):
                    handle.write(chunk)
            os.chmod(path, 0o755 if member.mode & 0o111 else 0o644)
            written.append(name)
        else:
            later.append((name, member))
    for name, member in later:  # links last: nothing is ever written through one
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if member.issym():
            os.symlink(member.linkname, path)
        else:
            os.link(dest / _clean_name(tarfile.TarInfo(member.linkname)), path)
        written.append(name)
    return sorted(written)


def sandbox_from_snapshot(
    data: bytes, root: str | Path, name: str, limits: SandboxLimits | None = None
) -> Sandbox:
    """A fresh sandbox ``root/name`` holding the snapshot's files (for grading a timed-out run)."""
    sandbox = Sandbox.create(root, name, limits=limits)
    extract_snapshot(data, sandbox.workspace)
    return sandbox
