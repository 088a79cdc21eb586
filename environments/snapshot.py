"""Workspace snapshots: a deterministic tar.gz of a workspace, stored under ``snapshots/``, and a
safe extraction into a fresh sandbox for grading.

When an execution hits its deadline the harness is stopped and ``snapshot_bytes`` packs the
workspace; ``write_snapshot`` puts it at ``<campaign root>/snapshots/<execution_id>.tar.gz`` (a local
folder or ``s3://...``; one whole-object write, so a retry rewrites the same bytes); the grader
reads it back (``read_snapshot``) and unpacks it with ``extract_snapshot`` (or
``sandbox_from_snapshot``) into a new workspace.

Determinism: entries sorted by path, mtime 0, uid/gid 0, empty owner names, modes 0o755 (folders
and executables) or 0o644, gzip header mtime 0; hard links become plain files; symlinks are kept
(as relative links) only when they stay inside the workspace; sockets, fifos and devices are left
out. The same tree gives the same bytes, whatever its timestamps.

Extraction trusts nothing: every member is checked before anything is written. Absolute names,
``..`` components, duplicate names, members below a symlink, symlinks whose target (followed
through the archive's other links) leaves the destination, hard links to anything but an earlier
regular file of the archive, devices, fifos and unknown types raise ``UnsafeArchive``.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import tarfile
from pathlib import Path, PurePosixPath

from environments.sandbox import Sandbox, SandboxLimits
from trajectory_store.storage import Store

MAX_LINK_HOPS = 40
EXECUTION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")


class UnsafeArchive(ValueError):
    """A snapshot member that extraction refuses: the message names the member and the reason."""


# -- packing ------------------------------------------------------------------------------------
def snapshot_bytes(workspace: str | Path) -> bytes:
    """The workspace as a deterministic tar.gz (see the module docstring for what is kept)."""
    root = Path(workspace).resolve()
    entries: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath, name)
            entries.append((full.relative_to(root).as_posix(), full))
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, compresslevel=9) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel, full in sorted(entries):
            info = _tar_info(root, rel, full)
            if info is None:
                continue
            if info.isreg():
                with open(full, "rb") as handle:  # streamed: a large workspace is never held whole
                    info.size = os.fstat(handle.fileno()).st_size
                    tar.addfile(info, handle)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def _tar_info(root: Path, rel: str, full: Path) -> tarfile.TarInfo | None:
    st = full.lstat()
    info = tarfile.TarInfo(rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if os.path.islink(full):
        target = full.resolve()
        if target != root and not target.is_relative_to(root):
            return None  # a link out of the workspace is not part of it
        info.type = tarfile.SYMTYPE
        info.linkname = os.path.relpath(target, full.parent.resolve())
        info.mode = 0o777
    elif full.is_dir():
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    elif full.is_file():
        info.type = tarfile.REGTYPE
        info.mode = 0o755 if st.st_mode & 0o111 else 0o644
    else:
        return None  # sockets, fifos, devices
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
            names = _check_members(members, max_bytes)
            return _extract(tar, members, names, dest.resolve() if dest.exists() else dest)
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


def _check_members(members: list[tarfile.TarInfo], max_bytes: int) -> list[str]:
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


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], names: list[str], dest: Path) -> list[str]:
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
            source = tar.extractfile(member)
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
