"""The snapshot section of `gyre bench store`: Parquet rows + content-addressed blobs against tar.gz.

One group of G executions of one problem times out; each workspace is the problem's template (a
small repository: sources, tests, a data file) with what its agent did: a few files edited, a few
added (notes, a new module, a log, byte code), sometimes one deleted. Every workspace is stored the
way the dispatcher stores it (environments/snapshot_rows.py ``store_workspace``, with the
template), and packed as the deterministic tar.gz the store used to keep.

- ``snapshot_bytes_over_targz``: bytes the store wrote for the group's snapshots (snapshot parts,
  the template's part, blob parts and manifests) / bytes of the group's tar.gz files.
- ``snapshot_first_bytes_over_targz``: the same for the group's first snapshot alone (it writes the
  template's blobs: no sharing yet).
- ``snapshot_dedup_ratio``: bytes of file contents the group's rows reference / bytes of distinct
  contents stored (blobs); ``snapshot_dedup_saved`` = 1 - 1/ratio, the share content addressing saves.
- write and read-back time per snapshot, for rows (``store_workspace``; ``materialise`` with a fresh
  blob index) and for tar (``snapshot_bytes`` + a file write; ``extract_snapshot``).
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from environments.snapshot import extract_snapshot, snapshot_bytes, workspace_entries
from environments.snapshot_rows import export_snapshot, materialise, store_workspace
from trajectory_store.snapshots import SnapshotStore
from trajectory_store.storage import Store, StoreConfig

GROUP_SIZE = 8
TEMPLATE_FILES = {"quick": 40, "full": 160}  # source files in the template; other presets: quick
WORDS = [
    "def",
    "return",
    "self",
    "value",
    "items",
    "index",
    "parse",
    "token",
    "buffer",
    "result",
    "error",
    "check",
    "config",
    "state",
    "node",
    "path",
    "open",
    "read",
    "write",
    "close",
    "update",
    "merge",
    "split",
    "join",
    "count",
    "total",
    "limit",
    "offset",
    "stream",
]


def _source(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        indent = "    " * rng.randint(0, 2)
        out.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + f"  # {i}")
    return "\n".join(out) + "\n"


def template(n_files: int, seed: int = 0) -> dict[str, str | bytes]:
    """A repository-shaped template: n_files sources in a package, their tests, docs, a data file."""
    rng = random.Random(seed)
    files: dict[str, str | bytes] = {
        "README.md": _source(rng, 30),
        "pyproject.toml": "[project]\nname = 'demo'\n",
    }
    for i in range(n_files):
        files[f"src/demo/mod_{i:03d}.py"] = _source(rng, rng.randint(30, 200))
        if i % 4 == 0:
            files[f"tests/test_mod_{i:03d}.py"] = _source(rng, rng.randint(20, 60))
    files["data/fixture.bin"] = rng.randbytes(32 << 10)
    return files


def _write(root: Path, files: dict[str, str | bytes]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)


def agent_workspace(root: Path, files: dict[str, str | bytes], member: int) -> Path:
    """The template after one agent's (partial) work: edits, additions, byte code, maybe a deletion."""
    rng = random.Random(1000 + member)
    ws = root / f"g{member}"
    _write(ws, files)
    sources = sorted(p for p in files if p.startswith("src/"))
    for rel in rng.sample(sources, 3):  # edited
        (ws / rel).write_text(str(files[rel]) + _source(rng, rng.randint(5, 40)))
    _write(
        ws,
        {
            "NOTES.md": _source(rng, 10),
            f"src/demo/new_{member}.py": _source(rng, rng.randint(20, 80)),
            "run.log": _source(rng, rng.randint(100, 400)),
            "src/demo/__pycache__/mod_000.cpython-311.pyc": rng.randbytes(4 << 10),
        },
    )
    if member % 3 == 0:
        (ws / sources[-1]).unlink()
    return ws


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run_snapshots(preset_name: str, workdir: str, group_size: int = GROUP_SIZE) -> dict[str, Any]:
    """Figures of the snapshot section (see the module docstring)."""
    files = template(TEMPLATE_FILES.get(preset_name, TEMPLATE_FILES["quick"]))
    root = Path(workdir) / "snapshot-workspaces"
    group = [agent_workspace(root, files, m) for m in range(group_size)]
    store = Store(StoreConfig(data_root=str(Path(workdir) / "snapshot-store"), campaign="bench"))
    snapshots = SnapshotStore(store)

    tar_bytes: list[int] = []
    tar_write_s = tar_read_s = rows_write_s = rows_read_s = 0.0
    rows_bytes: list[int] = []
    uris = []
    exports_match = True
    referenced = 0
    for member, ws in enumerate(group):
        referenced += sum(e.size for e in workspace_entries(ws) if e.kind == "file")
        started = time.perf_counter()
        data = snapshot_bytes(ws)
        tar_path = root / f"g{member}.tar.gz"
        tar_path.write_bytes(data)
        tar_write_s += time.perf_counter() - started
        tar_bytes.append(len(data))

        before = _dir_bytes(store.campaign_dir) if os.path.isdir(store.campaign_dir) else 0
        started = time.perf_counter()
        uri = store_workspace(
            snapshots,
            0,
            f"s0-bench-g{member}",
            ws,
            problem_id="bench",
            source="timeout",
            template_files=files,
        )
        rows_write_s += time.perf_counter() - started
        rows_bytes.append(_dir_bytes(store.campaign_dir) - before)
        uris.append(uri)
        exports_match &= export_snapshot(snapshots, uri) == data

        started = time.perf_counter()
        extract_snapshot(tar_path.read_bytes(), root / f"tar-out-{member}")
        tar_read_s += time.perf_counter() - started
        started = time.perf_counter()
        fresh = SnapshotStore(Store(store.config))  # a grader elsewhere: reads the blob index itself
        materialise(fresh, fresh.read(uri).entries, root / f"rows-out-{member}")
        rows_read_s += time.perf_counter() - started

    blobs = store.read_table("blobs")
    unique = sum(blobs.column("size").to_pylist())
    parts = {
        kind: sum(os.path.getsize(p) for p in store.visible_parts(kind)) for kind in ("snapshots", "blobs")
    }
    manifests = _dir_bytes(store.path("manifests"))
    total_rows, total_tar = sum(rows_bytes), sum(tar_bytes)
    return {
        "snapshot_group_size": group_size,
        "snapshot_template_files": len(files),
        "snapshot_template_bytes": sum(len(c) for c in files.values()),
        "snapshot_targz_bytes": total_tar,
        "snapshot_stored_bytes": total_rows,
        "snapshot_rows_part_bytes": parts["snapshots"],
        "snapshot_blob_part_bytes": parts["blobs"],
        "snapshot_manifest_bytes": manifests,
        "snapshot_bytes_over_targz": total_rows / total_tar,
        "snapshot_first_bytes_over_targz": rows_bytes[0] / tar_bytes[0],
        "snapshot_later_bytes_over_targz": sum(rows_bytes[1:]) / max(sum(tar_bytes[1:]), 1),
        "snapshot_referenced_content_bytes": referenced,
        "snapshot_unique_content_bytes": unique,
        "snapshot_blobs": blobs.num_rows,
        "snapshot_dedup_ratio": referenced / unique,
        "snapshot_dedup_saved": 1 - unique / referenced,
        "snapshot_write_s": rows_write_s / group_size,
        "snapshot_materialise_s": rows_read_s / group_size,
        "targz_write_s": tar_write_s / group_size,
        "targz_extract_s": tar_read_s / group_size,
        "snapshot_export_equals_targz": exports_match,
    }


def summary_lines(f: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, value) rows for bench/store.py's report."""
    return [
        (
            "snapshots: workload",
            f"a group of {f['snapshot_group_size']} timed-out executions of one problem, template "
            f"{f['snapshot_template_files']} files / {f['snapshot_template_bytes'] / 1024:.0f} KiB",
        ),
        (
            "snapshots: stored (rows + blobs) / tar.gz",
            f"{f['snapshot_bytes_over_targz']:.3f} x ({f['snapshot_stored_bytes'] / 1024:.0f} KiB vs "
            f"{f['snapshot_targz_bytes'] / 1024:.0f} KiB)",
        ),
        (
            "snapshots: first / later ones over tar.gz",
            f"{f['snapshot_first_bytes_over_targz']:.3f} x / {f['snapshot_later_bytes_over_targz']:.3f} x",
        ),
        (
            "snapshots: dedup (referenced / distinct)",
            f"{f['snapshot_dedup_ratio']:.2f} x: content addressing saves {f['snapshot_dedup_saved']:.1%}",
        ),
        (
            "snapshots: write / read back per snapshot",
            f"rows {f['snapshot_write_s'] * 1e3:.0f} ms / {f['snapshot_materialise_s'] * 1e3:.0f} ms, "
            f"tar.gz {f['targz_write_s'] * 1e3:.0f} ms / {f['targz_extract_s'] * 1e3:.0f} ms",
        ),
    ]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        figures = run_snapshots("quick", tmp)
    for name, value in summary_lines(figures):
        print(f"{name:<46} {value}")
