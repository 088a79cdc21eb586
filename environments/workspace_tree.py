"""Walking, removing and naming the trees an agent makes: iterative, bounded, never following a link,
never raising for what a workspace holds.

An agent controls its workspace, and a reward must come out of whatever it leaves there. It can make
a tree thousands of folders deep (Python 3.11's ``os.walk``, ``shutil.copytree`` and ``shutil.rmtree``
recurse and raise RecursionError; paths pass PATH_MAX), symlink loops (``Path.resolve`` raises), names
that are not UTF-8 or hold a backslash or a newline (Parquet strings and tar names refuse them), and
FIFOs that block a reader. So:

- ``walk`` visits a tree with an explicit stack, folders in sorted order, never below a link, at most
  ``MAX_DEPTH`` folders deep and ``MAX_PATH_BYTES`` of relative path, and reports what it leaves out
  (a name it cannot keep, a folder too deep, one it cannot read) instead of raising;
- ``link_inside`` tells where a symlink leads, inside the root or not, without raising on loops;
- ``remove_tree`` removes a tree of any depth (folders are moved up to the top before they are
  emptied, so it never holds more than two folders open).

The grading copy (environments/problems/grading_copy.py) and the snapshot (environments/snapshot.py)
both walk with ``walk``: they leave out the same paths for the same reasons, so the grade of a final
workspace and the grade of its snapshot see one tree.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_DEPTH = 64
"""Folders below the root that a walk descends into; deeper ones are left out, with a note."""
MAX_PATH_BYTES = 2048
"""UTF-8 bytes of a relative path a walk keeps (an absolute path stays far below PATH_MAX)."""


def name_problem(name: str) -> str | None:
    """Why a path component cannot be kept (None: it can): every tool downstream (Parquet rows,
    tar names, line-based listings, node ids) must be able to hold it."""
    try:
        name.encode("utf-8")  # os.listdir hands back undecodable bytes as lone surrogates
    except UnicodeEncodeError:
        return "a name that is not UTF-8"
    if "\\" in name:
        return "a backslash in the name"
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in name):
        return "a control character in the name"
    return None


def printable(rel: str) -> str:
    """``rel`` as one safe line for a note or a log: undecodable bytes and control characters escaped."""
    text = rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(char if 0x20 <= ord(char) != 0x7F else f"\\x{ord(char):02x}" for char in text)


@dataclass(frozen=True)
class Found:
    """One entry a walk visits: its relative path (``/``-separated), full path and ``lstat``."""

    rel: str
    path: str
    info: os.stat_result

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.info.st_mode)

    @property
    def is_link(self) -> bool:
        return stat.S_ISLNK(self.info.st_mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.info.st_mode)


Skip = Callable[[str, str], None]
"""Called with (relative path, why) for every path a walk leaves out."""


def walk(
    root: str | Path,
    skip: Skip,
    *,
    descend: Callable[[str], bool] = lambda rel: True,
    max_depth: int = MAX_DEPTH,
    max_path_bytes: int = MAX_PATH_BYTES,
    max_entries: int | None = None,
) -> Iterator[Found]:
    """Every entry below ``root`` (not ``root`` itself), depth first, each folder's names sorted, a
    folder before what it holds. Links are reported, never followed; a folder is entered only when
    ``descend(rel)`` says so. Leaves out, through ``skip``: names ``name_problem`` refuses, paths
    deeper than ``max_depth`` folders or longer than ``max_path_bytes``, folders it cannot read,
    entries that vanished, and everything after ``max_entries`` entries (the walk then stops)."""
    top = os.fspath(root)
    stack: list[tuple[str, int]] = [("", 0)]
    seen = 0
    while stack:
        folder, depth = stack.pop()
        try:
            names = sorted(os.listdir(os.path.join(top, folder) if folder else top))
        except OSError as exc:
            skip(folder or ".", f"a folder that cannot be read ({exc.strerror})")
            continue
        below: list[tuple[str, int]] = []
        for name in names:
            rel = f"{folder}/{name}" if folder else name
            why = name_problem(name)
            if why is None and len(rel.encode("utf-8")) > max_path_bytes:
                why = f"a path longer than {max_path_bytes} bytes"
            if why is not None:
                skip(rel, why)
                continue
            seen += 1
            if max_entries is not None and seen > max_entries:
                skip(rel, f"the walk stopped after {max_entries} entries")
                return
            full = os.path.join(top, rel)
            try:
                info = os.lstat(full)
            except OSError:
                continue  # gone since the listing
            found = Found(rel, full, info)
            yield found
            if found.is_dir and descend(rel):
                if depth + 1 >= max_depth:
                    skip(rel + "/", f"a folder more than {max_depth} levels deep")
                else:
                    below.append((rel, depth + 1))
        stack.extend(reversed(below))


def link_inside(root: str, link: str) -> str | None:
    """Where the symlink ``link`` leads, relative to the link's folder, when its real target lies
    inside ``root`` (the real path of the walk's root) and is not a loop; None otherwise."""
    target = os.path.realpath(link)  # never raises for loops (Path.resolve does)
    if target != root and not target.startswith(root + os.sep):
        return None
    try:
        os.stat(link)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
    return os.path.relpath(target, os.path.realpath(os.path.dirname(link)))


def remove_tree(path: str | Path) -> None:
    """Removes ``path`` (a folder of any depth, a file or a link; missing is fine) without recursion:
    each folder is moved up to the top folder before it is emptied, so at most two folders are
    open at a time whatever the depth. Never follows a link."""
    path = os.fspath(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
        return
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        pending, moved = [None], 0  # None: the top folder itself; else a name directly in it
        while pending:
            name = pending.pop()
            folder = (
                top
                if name is None
                else os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
            )
            try:
                with os.scandir(folder) as entries:
                    children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
                for child, is_dir in children:
                    if not is_dir:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(child, dir_fd=folder)
                    elif name is None:
                        pending.append(child)
                    else:
                        moved += 1
                        flat = f".gyre-rm-{moved}"
                        while os.path.lexists(os.path.join(path, flat)):
                            moved += 1
                            flat = f".gyre-rm-{moved}"
                        os.rename(child, flat, src_dir_fd=folder, dst_dir_fd=top)
                        pending.append(flat)
            finally:
                if folder != top:
                    os.close(folder)
            if name is not None:
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)
