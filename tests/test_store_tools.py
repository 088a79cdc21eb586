"""The store's tools must not lose data: `gyre sql` is read-only, a re-import never changes what is
stored, a corrupt part is named and can be quarantined (moved aside, never deleted) so the rest stays
queryable, and a committed part is never overwritten with other rows. Real DuckDB, real files,
the real CLI; every test also checks that the stored data is still all there afterwards."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from cli.main import main
from tests.records import SAMPLE, assert_same_records, read_jsonl
from trajectory_store.db import connect, verify_prompts
from trajectory_store.interchange import import_jsonl
from trajectory_store.schema import RecordError
from trajectory_store.storage import Store, StoreConfig, StoreError

COUNT_SQL = "SELECT execution_id, count(*) AS n FROM calls GROUP BY ALL ORDER BY ALL"
SAMPLE_COUNTS = [["p0-e0", 13], ["p0-e1", 16], ["p1-e0", 16], ["p1-e1", 10]]


@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    """The CLI reads defaults from the environment and sets PREFECT_HOME: keep both inside the test."""
    monkeypatch.delenv("GYRE_DATA_ROOT", raising=False)
    monkeypatch.delenv("GYRE_CAMPAIGN", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))


def snapshot(root: str) -> dict[str, str]:
    """Every file under a folder with the sha256 of its bytes."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return found


def sql_json(store_args: list[str], query: str, capsys) -> list[dict]:
    assert main(["sql", *store_args, "--format", "json", query]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def one_error_line(err: str) -> str:
    """stderr holds one `gyre: ...` line that explains, and no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("gyre: ")]
    assert lines, err
    return lines[0]


@pytest.fixture
def imported(tmp_path, cli_env, capsys) -> tuple[Store, list[str]]:
    """The sample trace imported through the CLI: (the store, the store options for later commands)."""
    store = Store(StoreConfig(data_root=str(tmp_path / "data"), campaign="tools"))
    store_args = ["--data-root", store.config.data_root, "--campaign", "tools"]
    assert main(["traj", "import", str(SAMPLE), *store_args]) == 0
    capsys.readouterr()
    return store, store_args


# -- 1. gyre sql is read-only ------------------------------------------------------------------


def refused_statements(store: Store, tmp_path: Path) -> dict[str, tuple[str, Path | None]]:
    """name -> (SQL that would change something, a file it would create, if any)."""
    part = store.visible_parts("calls")[0]
    outside = tmp_path / "outside"
    return {
        "copy_over_a_calls_part": (
            f"COPY (SELECT * FROM calls WHERE call_id = 0) TO '{part}' (FORMAT parquet, USE_TMP_FILE false)",
            None,
        ),
        "copy_to_any_file": (f"COPY (SELECT * FROM executions) TO '{outside}.csv'", Path(f"{outside}.csv")),
        "export_database": (f"EXPORT DATABASE '{outside}-db'", Path(f"{outside}-db")),
        "attach_a_database_file": (f"ATTACH '{outside}.duckdb' AS other", Path(f"{outside}.duckdb")),
        "attach_then_create_and_insert": (
            f"ATTACH '{outside}2.duckdb' AS o; CREATE TABLE o.t AS SELECT * FROM calls; INSERT INTO o.t "
            "SELECT * FROM calls",
            Path(f"{outside}2.duckdb"),
        ),
        "install_extension": ("INSTALL httpfs", None),
        "load_extension": ("LOAD httpfs", None),
        "create_table": ("CREATE TABLE mine AS SELECT * FROM executions", None),
        "set_to_undo_the_lock": ("SET enable_external_access = true", None),
        "set_lock_off": ("SET lock_configuration = false", None),
        "query_then_copy": (f"SELECT 1; COPY (SELECT 1) TO '{outside}3.csv'", Path(f"{outside}3.csv")),
        "explain_analyze_runs_a_copy": (
            f"EXPLAIN ANALYZE COPY (SELECT * FROM calls WHERE call_id = 0) TO '{part}' "
            "(FORMAT parquet, USE_TMP_FILE false)",
            None,
        ),
    }


REFUSED = [
    "copy_over_a_calls_part",
    "copy_to_any_file",
    "export_database",
    "attach_a_database_file",
    "attach_then_create_and_insert",
    "install_extension",
    "load_extension",
    "create_table",
    "set_to_undo_the_lock",
    "set_lock_off",
    "query_then_copy",
    "explain_analyze_runs_a_copy",
]


@pytest.mark.parametrize("name", REFUSED)
def test_sql_refuses_statements_that_change_anything(imported, tmp_path, capsys, name):
    store, store_args = imported
    query, would_create = refused_statements(store, tmp_path)[name]
    before = snapshot(store.campaign_dir)

    code = main(["sql", *store_args, query])

    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert "read-only" in line and "refused" in line, line
    assert would_create is None or not would_create.exists()
    assert snapshot(store.campaign_dir) == before
    assert [[r["execution_id"], r["n"]] for r in sql_json(store_args, COUNT_SQL, capsys)] == SAMPLE_COUNTS


@pytest.mark.parametrize(
    "query",
    [
        "SELECT * FROM read_csv('/etc/passwd', sep=':', header=false)",
        "SELECT content FROM read_text('/etc/passwd')",
        "SELECT * FROM glob('/etc/*')",
    ],
    ids=["read_csv", "read_text", "glob"],
)
def test_sql_reads_no_file_outside_the_store(imported, capsys, query):
    _, store_args = imported

    code = main(["sql", *store_args, query])

    captured = capsys.readouterr()
    assert code == 2
    assert "root:" not in captured.out and "passwd" not in captured.out
    assert "Permission Error" in captured.err and "/etc/" in captured.err
    assert "gyre sql is read-only" in captured.err and "Traceback" not in captured.err


def test_sql_reads_no_parquet_file_outside_the_store(imported, tmp_path, capsys):
    _, store_args = imported
    outside = tmp_path / "secret.parquet"
    pq.write_table(pa.table({"secret": ["do not show"]}), outside)

    code = main(["sql", *store_args, f"SELECT * FROM read_parquet('{outside}')"])

    captured = capsys.readouterr()
    assert code == 2 and "do not show" not in captured.out
    assert "Permission Error" in captured.err and str(outside) in captured.err


@pytest.mark.parametrize(
    ("query", "expect"),
    [
        ("WITH c AS (SELECT * FROM calls) SELECT count(*) AS n FROM c", [{"n": 55}]),
        ("FROM executions SELECT count(*) AS n", [{"n": 4}]),
        ("SELECT count(*) AS n FROM (DESCRIBE calls) WHERE column_name = 'new_ids'", [{"n": 1}]),
        ("SELECT count(*) > 5 AS many FROM (SHOW TABLES)", [{"many": True}]),
        ("SELECT count(*) AS n FROM (SUMMARIZE executions)", None),
        ("EXPLAIN SELECT count(*) FROM calls", None),
        ("EXPLAIN ANALYZE SELECT count(*) FROM trajectories", None),
        ("SELECT 1 AS a; SELECT count(*) AS n FROM selected_trajectories", None),
    ],
    ids=["with", "from-first", "describe", "show", "summarize", "explain", "explain-analyze", "two-queries"],
)
def test_sql_still_runs_every_kind_of_query(imported, capsys, query, expect):
    _, store_args = imported

    rows = sql_json(store_args, query, capsys)

    assert rows
    if expect is not None:
        assert rows == expect


def test_read_only_connection_itself_refuses_files_attach_extensions_and_set(imported, tmp_path):
    """Below the statement check: DuckDB's own settings hold even for a COPY sent straight to it."""
    store, _ = imported
    con = connect(store, read_only=True)
    before = snapshot(store.campaign_dir)

    attempts = {
        f"COPY (SELECT 1) TO '{tmp_path / 'x.csv'}'": duckdb.PermissionException,
        f"ATTACH '{tmp_path / 'x.duckdb'}' AS x": duckdb.PermissionException,
        "LOAD httpfs": duckdb.PermissionException,
        "SELECT * FROM read_csv('/etc/passwd')": duckdb.PermissionException,
        "SET enable_external_access = true": duckdb.InvalidInputException,
        "SET allowed_directories = ['/']": duckdb.InvalidInputException,
    }
    for statement, error in attempts.items():
        with pytest.raises(error):
            con.execute(statement)

    assert not any(tmp_path.glob("x.*"))
    assert snapshot(store.campaign_dir) == before
    assert con.execute("SELECT count(*) FROM training_tokens").fetchall()[0][0] > 0  # the views still read


# -- 2. a re-import never changes what is stored -------------------------------------------------


def write_records(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_reimport_of_the_same_records_is_idempotent_and_writes_nothing(imported, capsys):
    store, store_args = imported
    before = snapshot(store.campaign_dir)

    assert main(["traj", "import", str(SAMPLE), *store_args]) == 0

    out = capsys.readouterr().out
    assert "59 record(s) were already stored, unchanged" in out
    assert snapshot(store.campaign_dir) == before


def test_reimport_with_changed_content_is_refused_naming_execution_and_field(imported, tmp_path, capsys):
    store, store_args = imported
    records = read_jsonl(SAMPLE)
    changed = [dict(r) for r in records]
    changed[0]["reward"] = 1.0  # p0-e0's reward
    call_2 = next(i for i, r in enumerate(changed) if r.get("call_id") == 2 and r["execution_id"] == "p0-e0")
    changed[call_2]["output_ids"] = [
        (changed[call_2]["output_ids"][0] + 1) % 1000,
        *records[call_2]["output_ids"][1:],
    ]
    last = max(i for i, r in enumerate(changed) if r["execution_id"] == "p0-e0")
    extra = {**changed[last], "call_id": 13}  # p0-e0 is stored whole with 13 calls
    changed.insert(last + 1, extra)
    path = write_records(changed, tmp_path / "changed.jsonl")
    before = snapshot(store.campaign_dir)

    assert main(["traj", "import", str(path), *store_args]) == 1

    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("gyre: error: ")]
    assert len(errors) == 3, err
    assert "execution 'p0-e0', field 'reward'" in errors[0] and "stored 0.0, here 1.0" in errors[0]
    assert "execution 'p0-e0', call 2, field 'output_ids'" in errors[1] and "position 0" in errors[1]
    assert "execution 'p0-e0', call 13, field 'call_id'" in errors[2] and "13 calls" in errors[2]
    # nothing stored changed: the only new files hold the refused records, with their reasons
    after = snapshot(store.campaign_dir)
    assert {k: v for k, v in after.items() if k in before} == before
    assert all(name.startswith("quarantine/") for name in set(after) - set(before))
    assert sorted((e["execution_id"], e["call_id"] or -1, e["field"]) for e in store.quarantined()) == [
        ("p0-e0", -1, "reward"),
        ("p0-e0", 2, "output_ids"),
        ("p0-e0", 13, "call_id"),
    ]
    out = tmp_path / "export.jsonl"
    assert main(["traj", "export", str(out), *store_args]) == 0
    assert_same_records(records, read_jsonl(out))


def test_reimport_at_another_step_is_refused(imported, capsys):
    store, store_args = imported
    before = snapshot(store.campaign_dir)

    assert main(["traj", "import", str(SAMPLE), *store_args, "--step", "3"]) == 1

    err = capsys.readouterr().err
    assert "field 'step'" in err and "stored 0, here 3" in err
    assert {k: v for k, v in snapshot(store.campaign_dir).items() if k in before} == before
    assert [[r["execution_id"], r["n"]] for r in sql_json(store_args, COUNT_SQL, capsys)] == SAMPLE_COUNTS


def test_an_interrupted_import_completes_when_run_again(tmp_path):
    """The first 8 lines landed (p0-e0's row and 7 of its 13 calls): the full file adds the rest."""
    store = Store(StoreConfig(data_root=str(tmp_path / "data"), campaign="again"))
    records = read_jsonl(SAMPLE)
    assert import_jsonl(store, str(write_records(records[:8], tmp_path / "head.jsonl"))).quarantined == 0

    report = import_jsonl(store, str(SAMPLE))

    assert report.quarantined == 0, report.errors
    assert report.unchanged == 8
    out = tmp_path / "export.jsonl"
    from trajectory_store.interchange import export_jsonl

    export_jsonl(store, str(out))
    assert_same_records(records, read_jsonl(out))
    assert verify_prompts(connect(store)) == 55


def test_a_committed_part_is_never_overwritten_with_other_rows(store_config):
    store = Store(store_config)
    assert import_jsonl(store, str(SAMPLE)).quarantined == 0
    [part] = store.visible_parts("calls")
    rel = part[len(store.campaign_dir) + 1 :]
    key = Path(rel).stem.removeprefix("part-")
    stored = Path(part).read_bytes()
    table = store.read_table("calls")
    other = table.set_column(
        table.schema.get_field_index("agent_id"), "agent_id", pa.array(["x"] * len(table), pa.string())
    )

    assert store.write_part("calls", 0, table, key) == rel  # the same rows: a no-op
    with pytest.raises(StoreError, match="committed with other rows") as raised:
        store.write_part("calls", 0, other, key)

    assert rel in str(raised.value)
    assert Path(part).read_bytes() == stored
    # a part that no manifest lists was never visible: a retry may replace it
    orphan = store.write_part("calls", 7, other, "orphan")
    assert store.write_part("calls", 7, table, "orphan") == orphan
    assert (
        pq.read_table(store.path(orphan)).column("agent_id").to_pylist()
        == table.column("agent_id").to_pylist()
    )


# -- 3. a corrupt part is named, and quarantine keeps the rest queryable -------------------------


def garbage_in_header(data: bytes) -> bytes:
    """Garbage over the first page header: DuckDB's error ("invalid TType") names no file."""
    return data[:4] + os.urandom(296) + data[300:]


def all_garbage(data: bytes) -> bytes:
    return os.urandom(len(data))


@pytest.fixture
def two_steps(tmp_path, cli_env, capsys) -> tuple[Store, list[str]]:
    """p0's executions at step 0, p1's at step 1: one calls part per step."""
    store = Store(StoreConfig(data_root=str(tmp_path / "data"), campaign="two"))
    store_args = ["--data-root", store.config.data_root, "--campaign", "two"]
    records = read_jsonl(SAMPLE)
    for step, problem in ((0, "p0"), (1, "p1")):
        path = write_records(
            [r for r in records if r["execution_id"].startswith(problem)], tmp_path / f"{problem}.jsonl"
        )
        assert main(["traj", "import", str(path), *store_args, "--step", str(step)]) == 0
    capsys.readouterr()
    return store, store_args


def step_1_calls_part(store: Store) -> Path:
    [part] = [p for p in store.visible_parts("calls") if "/step=1/" in p]
    return Path(part)


@pytest.mark.parametrize("corrupt", [garbage_in_header, all_garbage], ids=["header", "whole-file"])
def test_a_corrupt_part_is_named_then_quarantined_and_the_rest_stays_queryable(
    two_steps, tmp_path, capsys, corrupt
):
    store, store_args = two_steps
    part = step_1_calls_part(store)
    part.write_bytes(corrupt(part.read_bytes()))
    corrupted = part.read_bytes()

    # every reader names the part and the way out, in one line
    export = ["traj", "export", str(tmp_path / "out.jsonl"), *store_args]
    for argv in (["traj", "stats", *store_args], ["sql", *store_args, COUNT_SQL], export):
        assert main(argv) == 2
        line = one_error_line(capsys.readouterr().err)
        assert str(part) in line and "unreadable calls part" in line and "--quarantine" in line, line

    assert main(["traj", "check", *store_args]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].startswith(f"{part}: unreadable calls part: ")
    assert "1 of 4 parts unreadable" in captured.err
    assert part.exists()  # check alone moves nothing

    assert main(["traj", "check", "--quarantine", *store_args]) == 0
    out = capsys.readouterr().out
    assert "1 of 4 parts quarantined" in out
    assert not part.exists()
    [entry] = store.quarantined_parts()
    moved = Path(store.path(entry["moved_to"]))
    assert moved.read_bytes() == corrupted  # kept, byte for byte
    assert entry["part"] == "calls/step=1/" + part.name and entry["reason"]
    assert entry["sha256"] == hashlib.sha256(corrupted).hexdigest()

    rows = sql_json(store_args, COUNT_SQL, capsys)
    assert [[r["execution_id"], r["n"]] for r in rows] == SAMPLE_COUNTS[:2]
    assert main(["traj", "check", *store_args]) == 0
    assert (
        "every part reads whole (executions 2, calls 1, metrics 0, snapshots 0, blobs 0)"
        in capsys.readouterr().out
    )


def test_check_finds_a_flipped_bit_that_duckdb_reads_without_error(tmp_path):
    """Uncompressed pages decode whatever their bytes: only the page checksum shows the flip."""
    from trajectory_store.parts import check_parts

    store = Store(StoreConfig(data_root=str(tmp_path / "data"), campaign="bits", compression="none"))
    assert import_jsonl(store, str(SAMPLE)).quarantined == 0
    [part] = store.visible_parts("calls")
    metadata = pq.ParquetFile(part).metadata.row_group(0)
    new_ids = next(
        metadata.column(i)
        for i in range(metadata.num_columns)
        if metadata.column(i).path_in_schema == "new_ids.list.element"
    )
    data = bytearray(Path(part).read_bytes())
    chunk_end = (new_ids.dictionary_page_offset or new_ids.data_page_offset) + new_ids.total_compressed_size
    data[chunk_end - 1] ^= 0x01  # one bit of the column's last page
    Path(part).write_bytes(bytes(data))

    assert connect(store).sql("SELECT count(*) FROM call_prompts").fetchall() == [(55,)]  # silently wrong
    problems, _ = check_parts(store)

    assert [p.part for p in problems] == ["calls/step=0/" + Path(part).name]
    assert "checksum" in problems[0].reason.lower()


def test_reimport_after_quarantine_restores_the_part(two_steps, tmp_path, capsys):
    store, store_args = two_steps
    part = step_1_calls_part(store)
    part.write_bytes(garbage_in_header(part.read_bytes()))
    assert main(["traj", "check", "--quarantine", *store_args]) == 0
    p1 = write_records(
        [r for r in read_jsonl(SAMPLE) if r["execution_id"].startswith("p1")], tmp_path / "p1.jsonl"
    )

    assert main(["traj", "import", str(p1), *store_args, "--step", "1"]) == 0

    capsys.readouterr()
    assert part.exists()
    assert [[r["execution_id"], r["n"]] for r in sql_json(store_args, COUNT_SQL, capsys)] == SAMPLE_COUNTS
    assert len(store.quarantined_parts()) == 1  # the corrupt copy stays in quarantine


def test_a_missing_part_is_listed_and_quarantine_records_it(two_steps, capsys):
    store, store_args = two_steps
    part = step_1_calls_part(store)
    part.unlink()

    assert main(["traj", "stats", *store_args]) == 2
    assert "missing" in one_error_line(capsys.readouterr().err)
    with pytest.raises(StoreError, match="missing: a manifest lists it") as raised:
        connect(store, steps=[1])  # what a step's pack opens: its parts, fetched at once
    assert str(part) in str(raised.value)
    assert main(["traj", "check", "--quarantine", *store_args]) == 0

    assert "(nothing: it was missing)" in capsys.readouterr().out
    [entry] = store.quarantined_parts()
    assert entry["missing"] and entry["moved_to"] is None
    assert [[r["execution_id"], r["n"]] for r in sql_json(store_args, COUNT_SQL, capsys)] == SAMPLE_COUNTS[:2]


def test_a_manifest_that_is_not_json_is_named(two_steps, capsys):
    store, store_args = two_steps
    manifest = sorted(Path(store.path("manifests")).rglob("*.json"))[0]
    manifest.write_text('{"files": ')

    assert main(["traj", "stats", *store_args]) == 2

    line = one_error_line(capsys.readouterr().err)
    assert str(manifest) in line and "manifest is not valid JSON" in line


# -- 5. verify_prompts (trajectory_store.db) ------------------------------------------------------


def test_verify_prompts_counts_every_call_and_names_a_wrong_hash(store_config):
    store = Store(store_config)
    assert import_jsonl(store, str(SAMPLE)).quarantined == 0
    assert verify_prompts(connect(store)) == 55
    [part] = store.visible_parts("calls")
    table = pq.read_table(part)
    wrong = pc.if_else(
        pc.and_(pc.equal(table["execution_id"], "p1-e0"), pc.equal(table["call_id"], 4)),
        "0" * 32,
        table["context_hash"],
    )
    pq.write_table(
        table.set_column(table.schema.get_field_index("context_hash"), "context_hash", wrong), part
    )

    with pytest.raises(RecordError) as raised:
        verify_prompts(connect(store))

    error = raised.value
    assert (error.execution_id, error.call_id, error.field) == ("p1-e0", 4, "context_hash")
