"""Workspace snapshots as Parquet rows: the rows hold exactly what the tar holds (the exported tar is
the workspace's tar, byte for byte), a group stores its shared files once, writes are idempotent and
visible only through their manifest, the views answer "what did timed-out executions change" on a
local store and on a real S3 API server, `gyre snapshot` gives the files back, and rows crafted to
escape are refused before anything is written."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import boto3
import pyarrow as pa
import pytest

from cli.main import main
from environments.snapshot import UnsafeArchive, extract_snapshot, snapshot_bytes, write_snapshot
from environments.snapshot_rows import (
    export_snapshot,
    materialise,
    sandbox_from_stored,
    store_workspace,
    template_entries,
)
from tests.test_snapshot import build_tree
from trajectory_store.db import connect, read_only_query
from trajectory_store.recorder import Recorder
from trajectory_store.schema import SCHEMA_VERSION, SNAPSHOTS_SCHEMA, RecordError
from trajectory_store.snapshots import SnapshotEntry, SnapshotStore
from trajectory_store.storage import Store, StoreConfig

TEMPLATE = {
    "README.md": "# parser\n",
    "src/parser.py": "def parse(text):\n    raise NotImplementedError\n",
    "tests/test_parser.py": "from src.parser import parse\n",
    "data/table.bin": bytes(range(256)) * 4,
}


def workspace(root: Path, name: str, changes: dict[str, str | None]) -> Path:
    """The template, with files changed, added or (None) removed."""
    ws = root / name
    for rel, content in {**TEMPLATE, **changes}.items():
        if content is None:
            continue
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_bytes(content.encode() if isinstance(content, str) else content)
    return ws


def files_under(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_rows_hold_what_the_tar_holds_and_export_is_the_same_tar(tmp_path):
    tree = build_tree(tmp_path / "ws")  # links in and out, a hard link, a fifo, modes
    snapshots = SnapshotStore(Store(StoreConfig(data_root=str(tmp_path / "data"))))

    uri = store_workspace(snapshots, 0, "s0-p-g0", tree, problem_id="p")

    stored = snapshots.read(uri)
    assert (stored.execution_id, stored.problem_id, stored.source, stored.template_id) == (
        "s0-p-g0",
        "p",
        "timeout",
        None,
    )
    assert [(e.path, e.kind, oct(e.mode)) for e in stored.entries] == [
        ("README.md", "file", "0o644"),
        ("abs_alias.md", "symlink", "0o777"),
        ("alias.md", "symlink", "0o777"),
        ("empty", "dir", "0o755"),
        ("hardlinked.md", "file", "0o644"),
        ("run.sh", "file", "0o755"),
        ("src", "dir", "0o755"),
        ("src/pkg", "dir", "0o755"),
        ("src/pkg/mod.py", "file", "0o644"),
    ]  # the escaping link and the fifo are left out, as in the tar
    assert export_snapshot(snapshots, uri) == snapshot_bytes(tree)
    written = materialise(snapshots, stored.entries, tmp_path / "out")
    assert written == ["README.md", "abs_alias.md", "alias.md", "hardlinked.md", "run.sh", "src/pkg/mod.py"]
    assert snapshot_bytes(tmp_path / "out") == snapshot_bytes(tree)
    assert len(snapshots.blob_index()) == 3  # README.md and its hard link share one blob


def test_template_entries_match_a_walked_template(tmp_path):
    from environments.snapshot import workspace_entries

    entries, read = template_entries(TEMPLATE)

    assert entries == workspace_entries(workspace(tmp_path, "t", {}))
    assert read(entries[-1]) == TEMPLATE["tests/test_parser.py"].encode()


def test_a_group_stores_shared_files_once_and_a_rewrite_adds_nothing(tmp_path):
    store = Store(StoreConfig(data_root=str(tmp_path / "data"), campaign="c"))
    group = [
        workspace(tmp_path, f"g{m}", {"src/parser.py": f"def parse(text):\n    return {m}\n"})
        for m in range(4)
    ]
    snapshots = SnapshotStore(store)

    uris = [
        store_workspace(snapshots, 3, f"s3-p-g{m}", ws, problem_id="p", template_files=TEMPLATE)
        for m, ws in enumerate(group)
    ]
    written = files_under(Path(store.campaign_dir))
    # a fresh writer (another process, a retried step) writes the same snapshots again
    again = [
        store_workspace(SnapshotStore(store), 3, f"s3-p-g{m}", ws, problem_id="p", template_files=TEMPLATE)
        for m, ws in enumerate(group)
    ]

    assert again == uris and files_under(Path(store.campaign_dir)) == written
    blobs = store.read_table("blobs")
    # 4 template files + 4 versions of parser.py, each once; 5 snapshot parts (4 + the template)
    assert blobs.num_rows == 8 and len(set(blobs.column("sha256").to_pylist())) == 8
    assert len(store.visible_parts("snapshots")) == 5
    assert all("/snapshots/step=3/" in uri for uri in uris)
    with pytest.raises(RecordError, match="kind 'socket'"):
        snapshots.write(
            0, [SnapshotEntry("x", "socket", 0)], bytes, execution_id="e", problem_id="p", source="timeout"
        )


def test_nothing_is_visible_before_the_manifest(tmp_path):
    store = Store(StoreConfig(data_root=str(tmp_path / "data")))
    snapshots = SnapshotStore(store)
    ws = workspace(tmp_path, "ws", {})
    real_commit = store.commit
    store.commit = lambda *a, **k: (_ for _ in ()).throw(OSError("crash before the manifest"))
    with pytest.raises(OSError):
        store_workspace(snapshots, 0, "s0-p-g0", ws, problem_id="p", template_files=TEMPLATE)
    assert store.visible_parts("snapshots") == [] and store.visible_parts("blobs") == []
    assert connect(store).sql("SELECT count(*) FROM snapshot_files").fetchall() == [(0,)]
    store.commit = real_commit

    uri = store_workspace(SnapshotStore(store), 0, "s0-p-g0", ws, problem_id="p", template_files=TEMPLATE)

    assert materialise(SnapshotStore(store), SnapshotStore(store).read(uri).entries, tmp_path / "out")


CHANGES_SQL = """
SELECT execution_id, path, change, size, template_size FROM snapshot_changes
WHERE change <> 'unchanged' ORDER BY ALL"""


def record_timeouts(store: Store, uris: dict[str, str], rewards: dict[str, float]) -> None:
    recorder = Recorder(store, step=0)
    for execution_id, uri in uris.items():
        recorder.record_execution(
            execution_id,
            "timeout",
            problem_id="p",
            group_id="s0-p",
            reward=rewards[execution_id],
            reward_source="workspace_snapshot",
            snapshot_uri=uri,
        )
    recorder.close()


PARSER = "def parse(text):\n    return text.split()\n"
RUNS = {
    "s0-p-g0": {"src/parser.py": PARSER, "notes.txt": "todo\n"},
    "s0-p-g1": {"README.md": None, "big.log": "x" * 70_000},
}


def group_of_timeouts(tmp_path: Path, store: Store) -> dict[str, str]:
    snapshots = SnapshotStore(store)
    runs = RUNS
    return {
        execution_id: store_workspace(
            snapshots, 0, execution_id, workspace(tmp_path, execution_id, changes), problem_id="p",
            template_files=TEMPLATE,
        )
        for execution_id, changes in runs.items()
    }  # fmt: skip


EXPECTED_CHANGES = [
    ("s0-p-g0", "notes.txt", "added", 5, None),
    ("s0-p-g0", "src/parser.py", "changed", len(PARSER), len(TEMPLATE["src/parser.py"])),
    ("s0-p-g1", "README.md", "removed", None, 9),
    ("s0-p-g1", "big.log", "added", 70_000, None),
]


def test_views_say_what_timed_out_executions_changed(tmp_path):
    store = Store(StoreConfig(data_root=str(tmp_path / "data")))
    uris = group_of_timeouts(tmp_path, store)
    record_timeouts(store, uris, {"s0-p-g0": 0.5, "s0-p-g1": 0.0})
    con = connect(store, read_only=True)

    assert read_only_query(con, CHANGES_SQL).fetchall() == EXPECTED_CHANGES
    texts = dict(
        read_only_query(
            con, "SELECT path, text FROM snapshot_files WHERE execution_id = 's0-p-g1' AND kind = 'file'"
        ).fetchall()
    )
    assert texts == {"big.log": None, "data/table.bin": None, "src/parser.py": TEMPLATE["src/parser.py"],
                     "tests/test_parser.py": TEMPLATE["tests/test_parser.py"]}  # fmt: skip
    # a partial reward, and the files it comes from
    partial = read_only_query(
        con,
        "SELECT c.path, f.text FROM snapshot_changes c JOIN executions e USING (execution_id) "
        "JOIN snapshot_files f USING (execution_id, path) WHERE e.reward > 0 AND c.change <> 'unchanged' "
        "ORDER BY ALL",
    ).fetchall()
    assert partial == [
        ("notes.txt", "todo\n"),
        ("src/parser.py", "def parse(text):\n    return text.split()\n"),
    ]
    distinct = {
        c.encode() if isinstance(c, str) else c for c in [*TEMPLATE.values(), PARSER, "todo\n", "x" * 70_000]
    }
    assert con.sql("SELECT count(*), sum(size) FROM blobs").fetchall() == [(7, sum(map(len, distinct)))]


def test_the_snapshot_an_execution_row_names_wins_over_a_rerun(tmp_path):
    store = Store(StoreConfig(data_root=str(tmp_path / "data")))
    snapshots = SnapshotStore(store)
    first = store_workspace(
        snapshots, 0, "s0-p-g0", workspace(tmp_path, "a", {"x.txt": "1\n"}), problem_id="p"
    )
    second = store_workspace(
        snapshots, 0, "s0-p-g0", workspace(tmp_path, "b", {"x.txt": "2\n"}), problem_id="p"
    )
    assert first != second
    record_timeouts(store, {"s0-p-g0": first}, {"s0-p-g0": 0.0})

    rows = connect(store).sql("SELECT text FROM snapshot_files WHERE path = 'x.txt'").fetchall()

    assert rows == [("1\n",)]
    assert snapshots.find("s0-p-g0") == first


def test_snapshots_on_s3(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    store = Store(StoreConfig(data_root=f"s3://{bucket}/runs", s3_endpoint_url=endpoint, campaign="c1"))
    uris = group_of_timeouts(tmp_path, store)
    record_timeouts(store, uris, {"s0-p-g0": 0.5, "s0-p-g1": 0.0})

    fresh = SnapshotStore(Store(store.config))  # nothing cached: everything read over HTTP
    sandbox = sandbox_from_stored(fresh, uris["s0-p-g1"], tmp_path / "grading", "x")
    assert files_under(sandbox.workspace) == files_under(tmp_path / "s0-p-g1")
    assert export_snapshot(fresh, uris["s0-p-g0"]) == snapshot_bytes(tmp_path / "s0-p-g0")
    assert read_only_query(connect(store, read_only=True), CHANGES_SQL).fetchall() == EXPECTED_CHANGES
    keys = [
        o["Key"] for o in boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket)["Contents"]
    ]
    assert {k.split("/")[3] for k in keys} == {"snapshots", "blobs", "manifests", "executions"}
    assert all(uri.startswith(f"s3://{bucket}/runs/campaigns/c1/snapshots/step=0/") for uri in uris.values())


# -- `gyre snapshot` and `gyre sql` ------------------------------------------------------------------
def test_cli_exports_restores_and_queries_snapshots(tmp_path, cli_env, capsys):
    store = Store(StoreConfig(data_root=str(tmp_path / "data"), campaign="c"))
    uris = group_of_timeouts(tmp_path, store)
    record_timeouts(store, uris, {"s0-p-g0": 0.5, "s0-p-g1": 0.0})
    legacy = write_snapshot(store, "s0-q-g0", snapshot_bytes(workspace(tmp_path, "old", {})))
    record_timeouts(store, {"s0-q-g0": legacy}, {"s0-q-g0": 0.0})
    where = ["--data-root", str(tmp_path / "data"), "--campaign", "c"]

    assert main(["snapshot", "export", "s0-p-g0", str(tmp_path / "out.tar.gz"), *where]) == 0
    assert (tmp_path / "out.tar.gz").read_bytes() == snapshot_bytes(tmp_path / "s0-p-g0")
    assert main(["snapshot", "restore", "s0-p-g1", str(tmp_path / "restored"), *where]) == 0
    assert files_under(tmp_path / "restored") == files_under(tmp_path / "s0-p-g1")
    assert main(["snapshot", "export", "s0-q-g0", str(tmp_path / "old.tar.gz"), *where]) == 0
    assert (tmp_path / "old.tar.gz").read_bytes() == snapshot_bytes(tmp_path / "old")  # the first format
    capsys.readouterr()
    assert main(["snapshot", "export", "nope", str(tmp_path / "x.tar.gz"), *where]) == 2
    assert "has no snapshot" in capsys.readouterr().err
    assert main(["sql", *where, "--format", "json", CHANGES_SQL]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [tuple(r.values()) for r in rows] == EXPECTED_CHANGES


# -- rows crafted to escape ------------------------------------------------------------------------
def crafted(store: Store, rows: list[dict], blobs: dict[str, bytes] | None = None, *, keys=None) -> str:
    """Commits rows as a snapshot part exactly as given (no writer checks), with blobs stored under
    the given keys (default: their true sha256); returns the URI."""
    full = [
        {"snapshot_id": "crafted", "execution_id": "evil", "problem_id": "p", "step": 0, "source": "timeout",
         "template_id": None, "size": 0, "sha256": None, "link_target": None, "mode": 0o644,
         "schema_version": SCHEMA_VERSION, **row}
        for row in rows
    ]  # fmt: skip
    parts = {
        "snapshots": [store.write_part("snapshots", 0, pa.Table.from_pylist(full, SNAPSHOTS_SCHEMA), "evil")]
    }
    blobs = {"harmless": b"ok", **(blobs or {})}
    table = pa.table(
        {
            "sha256": [
                (keys or {}).get(name, hashlib.sha256(data).hexdigest()) for name, data in blobs.items()
            ],
            "size": [len(data) for data in blobs.values()],
            "data": pa.array(list(blobs.values()), pa.large_binary()),
            "schema_version": [SCHEMA_VERSION] * len(blobs),
        }
    )
    parts["blobs"] = [store.write_part("blobs", 0, table, "evil")]
    store.commit(0, parts, {"snapshots": len(full), "blobs": len(blobs)})
    return store.url(store.path(parts["snapshots"][0]))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_row(path: str, data: bytes = b"evil") -> dict:
    return {"path": path, "kind": "file", "size": len(data), "sha256": sha(data)}


def link_row(path: str, target: str) -> dict:
    return {"path": path, "kind": "symlink", "mode": 0o777, "link_target": target}


HARMLESS = file_row("harmless.txt", b"ok")
ROW_ATTACKS = {
    "absolute": ([file_row("/tmp/gyre-slip-abs")], "absolute path"),
    "dotdot": ([file_row("../gyre-slip")], "'..' component"),
    "dotdot-inside": ([file_row("a/../../gyre-slip")], "'..' component"),
    "symlink-absolute": ([link_row("link", "/etc")], "absolute path"),
    "symlink-up": ([link_row("sub/link", "../../outside")], "leads outside"),
    "symlink-chain": ([link_row("here", "."), link_row("up", "here/..")], "leads outside"),
    "write-through-symlink": ([link_row("dir", "sub"), file_row("dir/x.txt")], "below the symlink"),
    "char-device": ([{"path": "null", "kind": "chardev"}], "device or fifo"),
    "block-device": ([{"path": "disk", "kind": "blockdev"}], "device or fifo"),
    "fifo": ([{"path": "pipe", "kind": "fifo"}], "device or fifo"),
    "hard-link": ([{"path": "hard", "kind": "hardlink", "link_target": "/etc/passwd"}], "unsupported kind"),
    "duplicate": ([file_row("harmless.txt", b"ok")], "duplicate name"),
    "file-without-content": ([{"path": "a.txt", "kind": "file", "size": 4}], "not in the store"),
    "missing-blob": ([{**file_row("a.txt"), "sha256": sha(b"never stored")}], "not in the store"),
    "size-lie": ([{**file_row("a.txt"), "size": 2}], "declares 2 bytes, its blob holds 4"),
    "dir-with-size": ([{"path": "d", "kind": "dir", "size": 10**9}], "with a size"),
}


@pytest.mark.parametrize("case", list(ROW_ATTACKS))
def test_crafted_rows_are_refused_before_anything_is_written(tmp_path, case):
    store = Store(StoreConfig(data_root=str(tmp_path / "data")))
    rows, reason = ROW_ATTACKS[case]
    uri = crafted(store, [HARMLESS, *rows], {"evil": b"evil"})
    box = tmp_path / "box"
    (box / "outside").mkdir(parents=True)
    (box / "outside" / "target.txt").write_text("keep")
    snapshots = SnapshotStore(store)

    with pytest.raises(UnsafeArchive, match=reason) as refused:
        materialise(snapshots, snapshots.read(uri).entries, box / "dest")
    with pytest.raises(UnsafeArchive, match=reason):
        sandbox_from_stored(snapshots, uri, box / "grading", "x")  # the dispatcher's path
    with pytest.raises(UnsafeArchive, match=reason):
        export_snapshot(snapshots, uri)  # never a tar that would be unsafe to extract

    assert repr(rows[-1]["path"])[1:-1] in str(refused.value) or case == "size-lie"
    assert sorted(p.name for p in box.iterdir()) == ["outside"]
    assert [p.name for p in (box / "outside").iterdir()] == ["target.txt"]
    assert not Path("/tmp/gyre-slip-abs").exists() and not (tmp_path / "gyre-slip").exists()


def test_a_blob_whose_bytes_do_not_match_its_key_is_refused(tmp_path):
    store = Store(StoreConfig(data_root=str(tmp_path / "data")))
    uri = crafted(store, [HARMLESS, file_row("a.txt", b"good")], {"a": b"evil"}, keys={"a": sha(b"good")})
    snapshots = SnapshotStore(store)

    with pytest.raises(UnsafeArchive, match="do not hash to its key"):
        materialise(snapshots, snapshots.read(uri).entries, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_limits_on_entries_and_bytes(tmp_path):
    store = Store(StoreConfig(data_root=str(tmp_path / "data")))
    zeros = bytes(1 << 20)
    many = [{"path": f"d{i}", "kind": "dir"} for i in range(1001)]
    uri_many = crafted(store, many)
    uri_big = crafted(
        Store(StoreConfig(data_root=str(tmp_path / "data2"))),
        [file_row(f"f{i}.bin", zeros) for i in range(3)],
        {"zeros": zeros},
    )
    with pytest.raises(UnsafeArchive, match="more than 1000 entries"):
        materialise(
            SnapshotStore(store),
            SnapshotStore(store).read(uri_many).entries,
            tmp_path / "a",
            max_members=1000,
        )
    big = SnapshotStore(Store(StoreConfig(data_root=str(tmp_path / "data2"))))
    with pytest.raises(UnsafeArchive, match="more than 2097152 bytes"):
        materialise(big, big.read(uri_big).entries, tmp_path / "b", max_bytes=2 << 20)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_exported_tar_extracts_with_the_tar_checks(tmp_path):
    store = Store(StoreConfig(data_root=str(tmp_path / "data")))
    ws = workspace(tmp_path, "ws", {"link": None})
    (ws / "link").symlink_to("README.md")
    uri = store_workspace(SnapshotStore(store), 0, "s0-p-g0", ws, problem_id="p")

    data = export_snapshot(SnapshotStore(store), uri)

    assert sorted(extract_snapshot(data, tmp_path / "out")) == sorted(
        ["README.md", "data/table.bin", "link", "src/parser.py", "tests/test_parser.py"]
    )
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        assert {m.mtime for m in tar.getmembers()} == {0}


class CountingSnapshots(SnapshotStore):
    """The real store, counting the blob bytes each part read hands over (a spy, not a stand-in)."""

    reads: list[tuple[str, int]]

    def part_blobs(self, path: str, wanted: list[str]) -> dict[str, bytes]:
        blobs = super().part_blobs(path, wanted)
        self.reads.append((path, sum(len(data) for data in blobs.values())))
        return blobs


def test_a_restore_holds_one_blob_part_at_a_time(tmp_path):
    # 12 files of 40 KB in parts of at most 100 KB: 6 parts; a restore must never hold them all
    files = {f"src/module_{i}.bin": bytes([i]) * 40_000 for i in range(12)}
    ws = workspace(tmp_path, "ws", files)
    store = Store(StoreConfig(data_root=str(tmp_path / "store"), campaign="c"))
    uri = store_workspace(SnapshotStore(store, blob_part_bytes=100_000), 0, "e1", ws, problem_id="p")
    snapshots = CountingSnapshots(store)
    snapshots.reads = []
    written = materialise(snapshots, snapshots.read(uri).entries, tmp_path / "restored")
    assert files_under(tmp_path / "restored") == files_under(ws) and written
    parts = {path for path, _ in snapshots.reads}
    assert len(parts) >= 5
    assert max(held for _, held in snapshots.reads) <= 100_000
    # each part read twice: once to check every blob before anything is written, once to write
    assert sorted(path for path, _ in snapshots.reads) == sorted(list(parts) * 2)
