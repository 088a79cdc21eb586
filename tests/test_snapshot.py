"""Workspace snapshots: the same tree always packs to the same bytes, round trips exactly, is stored
under snapshots/ on a local disk and on a real S3 API server, and extraction refuses every tar-slip
trick before writing anything."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import boto3
import pytest

from environments.snapshot import (
    UnsafeArchive,
    extract_snapshot,
    read_snapshot,
    sandbox_from_snapshot,
    snapshot_bytes,
    write_snapshot,
)
from trajectory_store.storage import Store, StoreConfig


def build_tree(root: Path) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "README.md").write_text("# demo\n")
    (root / "src" / "pkg" / "mod.py").write_text("x = 1\n")
    run = root / "run.sh"
    run.write_text("#!/bin/sh\necho ok\n")
    run.chmod(0o775)
    (root / "src" / "pkg" / "mod.py").chmod(0o600)
    (root / "alias.md").symlink_to("README.md")
    (root / "abs_alias.md").symlink_to(root / "src" / "pkg" / "mod.py")
    (root / "escape").symlink_to("/etc/passwd")
    os.link(root / "README.md", root / "hardlinked.md")
    os.mkfifo(root / "pipe")
    return root


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def test_snapshot_is_deterministic_and_normalised(tmp_path):
    tree = build_tree(tmp_path / "a")
    first = snapshot_bytes(tree)
    for path in tree.rglob("*"):
        if not path.is_symlink() and not path.is_fifo():
            os.utime(path, (1_000_000, 2_000_000))
    second = snapshot_bytes(tree)
    elsewhere = snapshot_bytes(build_tree(tmp_path / "b" / "deeper"))  # links are stored relative

    assert first == second == elsewhere
    assert first[4:8] == b"\x00\x00\x00\x00"  # gzip header mtime
    found = members(first)
    assert list(found) == sorted(found)
    assert set(found) == {
        "README.md", "abs_alias.md", "alias.md", "empty", "hardlinked.md", "run.sh", "src", "src/pkg",
        "src/pkg/mod.py",
    }  # fmt: skip
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in found.values()} == {(0, 0, 0, "", "")}
    assert found["run.sh"].mode == 0o755 and found["src/pkg/mod.py"].mode == 0o644
    assert found["hardlinked.md"].isreg()
    assert found["abs_alias.md"].linkname == "src/pkg/mod.py"


def test_snapshot_round_trips(tmp_path):
    tree = build_tree(tmp_path / "a")
    data = snapshot_bytes(tree)

    written = extract_snapshot(data, tmp_path / "out")

    out = tmp_path / "out"
    assert written == ["README.md", "abs_alias.md", "alias.md", "hardlinked.md", "run.sh", "src/pkg/mod.py"]
    assert (out / "alias.md").read_text() == "# demo\n"
    assert (out / "abs_alias.md").read_text() == "x = 1\n"
    assert os.access(out / "run.sh", os.X_OK)
    assert (out / "empty").is_dir()
    assert snapshot_bytes(out) == data


# -- tar-slip ------------------------------------------------------------------------------------
def archive(*entries: tuple[str, str, str]) -> bytes:
    """A tar.gz whose first member is a harmless file, then (name, type, linkname) entries."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        ok = tarfile.TarInfo("harmless.txt")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"ok"))
        for name, kind, linkname in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = linkname
            if kind == tarfile.REGTYPE:
                info.size = 4
                tar.addfile(info, io.BytesIO(b"evil"))
            else:
                tar.addfile(info)
    return buffer.getvalue()


SLIPS = {
    "absolute": [("/tmp/gyre-slip-abs", tarfile.REGTYPE, "")],
    "dotdot": [("../gyre-slip", tarfile.REGTYPE, "")],
    "dotdot-inside": [("a/../../gyre-slip", tarfile.REGTYPE, "")],
    "symlink-absolute": [("link", tarfile.SYMTYPE, "/etc")],
    "symlink-up": [("sub/link", tarfile.SYMTYPE, "../../outside")],
    "symlink-chain": [("here", tarfile.SYMTYPE, "."), ("up", tarfile.SYMTYPE, "here/..")],
    "write-through-symlink": [("dir", tarfile.SYMTYPE, "sub"), ("dir/x.txt", tarfile.REGTYPE, "")],
    "hardlink-absolute": [("hard", tarfile.LNKTYPE, "/etc/passwd")],
    "hardlink-up": [("hard", tarfile.LNKTYPE, "../outside/target.txt")],
    "hardlink-unknown": [("hard", tarfile.LNKTYPE, "not-in-archive.txt")],
    "char-device": [("null", tarfile.CHRTYPE, "")],
    "block-device": [("disk", tarfile.BLKTYPE, "")],
    "fifo": [("pipe", tarfile.FIFOTYPE, "")],
    "duplicate": [("harmless.txt", tarfile.REGTYPE, "")],
}


@pytest.mark.parametrize("case", list(SLIPS))
def test_extraction_refuses_tar_slip_before_writing_anything(tmp_path, case):
    dest = tmp_path / "box" / "dest"
    outside = tmp_path / "box" / "outside"
    outside.mkdir(parents=True)
    (outside / "target.txt").write_text("keep")

    with pytest.raises(UnsafeArchive) as refused:
        extract_snapshot(archive(*SLIPS[case]), dest)

    assert SLIPS[case][-1][0] in str(refused.value)  # names the member
    assert not dest.exists()
    assert sorted(p.name for p in (tmp_path / "box").iterdir()) == ["outside"]
    assert [p.name for p in outside.iterdir()] == ["target.txt"]
    assert not Path("/tmp/gyre-slip-abs").exists()


def test_extraction_accepts_links_that_stay_inside(tmp_path):
    data = archive(
        ("sub", tarfile.DIRTYPE, ""),
        ("sub/file.txt", tarfile.REGTYPE, ""),
        ("sub/up", tarfile.SYMTYPE, "../harmless.txt"),
        ("hard", tarfile.LNKTYPE, "sub/file.txt"),
    )

    written = extract_snapshot(data, tmp_path / "dest")

    assert written == ["hard", "harmless.txt", "sub/file.txt", "sub/up"]
    assert (tmp_path / "dest" / "sub" / "up").read_text() == "ok"
    assert (tmp_path / "dest" / "hard").read_text() == "evil"


def test_extraction_refuses_garbage_and_a_full_destination(tmp_path):
    with pytest.raises(UnsafeArchive):
        extract_snapshot(b"not a tarball", tmp_path / "a")
    with pytest.raises(UnsafeArchive):
        extract_snapshot(gzip.compress(b"x" * 1000), tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "old.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        extract_snapshot(archive(), tmp_path / "c")


# -- storage -------------------------------------------------------------------------------------
def test_write_snapshot_locally_is_idempotent(tmp_path):
    store = Store(StoreConfig(data_root=str(tmp_path / "data"), campaign="c1"))
    data = snapshot_bytes(build_tree(tmp_path / "ws"))

    uri = write_snapshot(store, "exec-7", data)
    again = write_snapshot(store, "exec-7", data)

    assert uri == again == f"{tmp_path}/data/campaigns/c1/snapshots/exec-7.tar.gz"
    assert os.listdir(Path(uri).parent) == ["exec-7.tar.gz"]
    assert read_snapshot(store, uri) == data
    with pytest.raises(ValueError):
        write_snapshot(store, "../escape", data)


def test_write_snapshot_to_s3(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    config = StoreConfig(data_root=f"s3://{bucket}/runs", s3_endpoint_url=endpoint, campaign="c1")
    store = Store(config)
    data = snapshot_bytes(build_tree(tmp_path / "ws"))

    uri = write_snapshot(store, "exec-7", data)

    assert uri == f"s3://{bucket}/runs/campaigns/c1/snapshots/exec-7.tar.gz"
    assert read_snapshot(store, uri) == data
    listed = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    assert [obj["Key"] for obj in listed] == ["runs/campaigns/c1/snapshots/exec-7.tar.gz"]


def test_timed_out_workspace_is_graded_in_a_fresh_sandbox(tmp_path):
    from environments.sandbox import Sandbox

    worker = Sandbox.create(tmp_path / "runs", "exec-7", {"answer.txt": "42\n"})
    worker.run("echo partial >> answer.txt; sleep 100", timeout_s=1)
    store = Store(StoreConfig(data_root=str(tmp_path / "data")))
    uri = write_snapshot(store, "exec-7", snapshot_bytes(worker.workspace))

    grader = sandbox_from_snapshot(read_snapshot(store, uri), tmp_path / "grading", "exec-7")
    result = grader.run("cat answer.txt")

    assert grader.workspace != worker.workspace
    assert result.stdout == "42\npartial\n"


def test_extraction_bounds_total_bytes_and_members(tmp_path):
    zeros = io.BytesIO()
    with tarfile.open(fileobj=zeros, mode="w:gz") as tar:
        info = tarfile.TarInfo("zeros.bin")
        info.size = 64 << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    assert len(zeros.getvalue()) < 1 << 20  # a small archive...
    with pytest.raises(UnsafeArchive, match="more than"):  # ...that unpacks to too much
        extract_snapshot(zeros.getvalue(), tmp_path / "a", max_bytes=16 << 20)
    many = io.BytesIO()
    with tarfile.open(fileobj=many, mode="w:gz") as tar:
        for index in range(1001):
            tar.addfile(tarfile.TarInfo(f"f{index}"), io.BytesIO())
    with pytest.raises(UnsafeArchive, match="more than 1000 members"):
        extract_snapshot(many.getvalue(), tmp_path / "b", max_members=1000)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    assert not (tmp_path / "b").exists()
