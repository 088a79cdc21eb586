"""The one DuckDB connection factory: the store's filesystem, no downloads, the views.

    con = connect(Store(StoreConfig(data_root="s3://bucket/runs")))
    con.sql("SELECT * FROM trajectories LIMIT 5").show()

Views (trajectory_store/sql/*.sql, run in name order): executions, calls, metrics, call_segments,
call_prompts, policy_spans, tree_nodes, call_path_policy, trajectories, selected_trajectories,
training_nodes, training_tokens, execution_stats, and over workspace snapshots snapshots,
snapshot_files, snapshot_changes, blobs (07_snapshots.sql). Selection settings live in the small tables
selection_config, role_priority and trainable_statuses, which users can read too.

``connect(store, read_only=True)`` + ``read_only_query`` is what `gyre sql` runs user SQL on: the
views and nothing else (no file written or read beside the parts, no database attached, no
extension, no setting changed back). ``verify_prompts`` and ``tree_counts`` are the checks and
figures of the rebuild-trees task. A read that fails because a part is unreadable raises a
StoreError naming the part (parts.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import resources
from typing import Any

import duckdb
import numpy as np

from trajectory_store.config import SelectionConfig
from trajectory_store.parts import REQUIRED_COLUMNS, bare_connection, naming_bad_parts, read_parts
from trajectory_store.schema import SCHEMA_VERSION, SCHEMAS, RecordError, context_hash
from trajectory_store.storage import KINDS, Store

VIEWS = (
    "executions",
    "calls",
    "metrics",
    "call_prompts",
    "tree_nodes",
    "trajectories",
    "selected_trajectories",
    "training_nodes",
    "training_tokens",
    "execution_stats",
    "snapshots",
    "snapshot_files",
    "snapshot_changes",
    "blobs",
)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _check_stored(con: duckdb.DuckDBPyConnection) -> None:
    """Validation on read, over every part at once: the first row this gyrerl cannot use, named."""
    for kind, required in REQUIRED_COLUMNS.items():
        missing = " OR ".join(f"{column} IS NULL" for column in required)
        bad = con.execute(
            f"SELECT filename, schema_version, {', '.join(required)} FROM {kind}_raw "
            f"WHERE schema_version IS DISTINCT FROM {SCHEMA_VERSION} OR {missing} LIMIT 1"
        ).fetchall()
        if bad:
            filename, version, *values = bad[0]
            if version != SCHEMA_VERSION:
                reason = f"schema_version {version}, this gyrerl reads {SCHEMA_VERSION}"
            else:
                reason = "missing " + ", ".join(c for c, v in zip(required, values, strict=True) if v is None)
            raise RecordError(f"{filename}: {kind} row has {reason}")


def connect(
    store: Store,
    selection: SelectionConfig | None = None,
    *,
    steps: Iterable[int] | None = None,
    threads: int | None = None,
    read_only: bool = False,
) -> duckdb.DuckDBPyConnection:
    """A connection with the views over the parts visible now.

    steps: those steps' parts only, fetched at once and held in memory (blobs excepted): what a
    step's pack and figures use. Views over every part of a campaign read every part again in each
    query (on object storage: requests per part and query, one after another), so a group's pack
    took seconds and cost more with each step the campaign had made.

    read_only: once the views exist, the connection may read those parts and nothing else: no file
    written (COPY, EXPORT), no database attached, no extension installed or loaded, no other file
    read, and no SET that would undo it (DuckDB's enable_external_access off, allowed_paths = the
    parts, lock_configuration on). `gyre sql` runs user SQL on such a connection, through
    read_only_query, which also refuses every statement but a query.
    """
    selection = selection or SelectionConfig()
    con = bare_connection(store, threads=threads)
    readable: list[str] = []
    with naming_bad_parts(store):
        visible = store.visible(steps)
        for kind in KINDS:
            parts = [store.url(p) for p in visible[kind]]
            readable += parts
            # a step's parts are read into memory, blobs (workspace file contents) excepted
            if parts and (steps is None or kind == "blobs"):
                listing = ", ".join(_quote(p) for p in parts)
                columns = ", ".join(SCHEMAS[kind].names)
                con.execute(
                    f"CREATE OR REPLACE VIEW {kind}_raw AS SELECT {columns}, filename "
                    f"FROM read_parquet([{listing}], union_by_name=true, filename=true)"
                )
            else:
                rows = read_parts(store, kind, visible[kind])
                con.register(f"{kind}_rows", rows)
                con.execute(f"CREATE OR REPLACE TABLE {kind}_raw AS SELECT * FROM {kind}_rows")
                con.unregister(f"{kind}_rows")
        _check_stored(con)
        con.execute(
            "CREATE TABLE selection_config AS SELECT ?::BIGINT AS j_max, ?::BIGINT AS seed",
            [selection.j_max, selection.seed],
        )
        con.execute("CREATE TABLE role_priority (role VARCHAR, priority INTEGER)")
        con.executemany(
            "INSERT INTO role_priority VALUES (?, ?)", [[r, i] for i, r in enumerate(selection.role_priority)]
        )
        con.execute("CREATE TABLE trainable_statuses (status VARCHAR)")
        con.executemany(
            "INSERT INTO trainable_statuses VALUES (?)", [[s] for s in selection.trainable_statuses]
        )
        sql_dir = resources.files("trajectory_store") / "sql"
        for entry in sorted(sql_dir.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".sql"):
                con.execute(entry.read_text())
    if read_only:
        _lock(con, readable)
    return con


def _lock(con: duckdb.DuckDBPyConnection, readable: list[str]) -> None:
    # allowed_paths lets the views read their parts once external access is off; it would let a
    # COPY write them too, which is why read_only_query admits queries only. The order matters:
    # each setting is refused once the one after it is on.
    if readable:
        con.execute(f"SET allowed_paths = [{', '.join(_quote(p) for p in readable)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


class ReadOnlyError(ValueError):
    """A statement that `gyre sql` refuses because it could change something."""


_QUERY_STATEMENTS = "SELECT, WITH, FROM, VALUES, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN"


def read_only_query(con: duckdb.DuckDBPyConnection, sql: str) -> duckdb.DuckDBPyRelation | None:
    """Runs ``sql`` if every statement in it is a query; the result of the last one.

    DuckDB types DESCRIBE, SHOW and SUMMARIZE as SELECT. EXPLAIN ANALYZE runs its statement, so an
    EXPLAIN passes only when what it explains is a query; anything that does not parse as one
    (options, comments before EXPLAIN) is refused rather than guessed at.
    """
    for statement in con.extract_statements(sql):
        if not _is_query(con, statement):
            text = " ".join(statement.query.split()).rstrip(";")
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise ReadOnlyError(
                f"gyre sql is read-only: refused {statement.type.name} statement {shown!r}; "
                f"it runs queries ({_QUERY_STATEMENTS}) over the views"
            )
    return con.sql(sql)


def _is_query(con: duckdb.DuckDBPyConnection, statement: Any) -> bool:
    if statement.type == duckdb.StatementType.SELECT:
        return True
    if statement.type != duckdb.StatementType.EXPLAIN:
        return False
    explained = re.match(r"\s*EXPLAIN\s+(?:ANALY[SZ]E\s+)?(.*)", statement.query, re.IGNORECASE | re.DOTALL)
    if explained is None:
        return False
    try:
        inner = con.extract_statements(explained.group(1))
    except duckdb.Error:
        return False
    return bool(inner) and all(s.type == duckdb.StatementType.SELECT for s in inner)


def verify_prompts(con: duckdb.DuckDBPyConnection) -> int:
    """Rebuilds every call's prompt (call_prompts) and checks its length and its context_hash.

    Returns the number of prompts verified; raises RecordError naming the first call whose rebuilt
    prompt differs from what the recorder hashed. The hash runs in Python over one Arrow batch at a
    time (blake2b is not a DuckDB function), so memory stays at one batch of prompts.
    """
    bad = con.sql(
        "SELECT p.execution_id, p.call_id FROM call_prompts p JOIN calls c USING (execution_id, call_id) "
        "WHERE len(p.prompt_ids) <> c.prompt_len ORDER BY ALL LIMIT 1"
    ).fetchall()
    if bad:
        raise RecordError(
            "the rebuilt prompt has the wrong length", execution_id=bad[0][0], call_id=bad[0][1]
        )
    reader = con.sql("SELECT execution_id, call_id, prompt_ids, context_hash FROM call_prompts").arrow()
    batches = reader if hasattr(reader, "read_next_batch") else reader.to_batches()
    verified = 0
    for batch in batches:
        prompts = batch.column("prompt_ids")
        values = prompts.flatten().to_numpy()
        offsets = prompts.offsets.to_numpy() - prompts.offsets[0].as_py()
        for i, (execution_id, call_id, expected) in enumerate(
            zip(
                batch.column("execution_id").to_pylist(),
                batch.column("call_id").to_pylist(),
                batch.column("context_hash").to_pylist(),
                strict=True,
            )
        ):
            if context_hash(np.asarray(values[offsets[i] : offsets[i + 1]])) != expected:
                raise RecordError(
                    "the rebuilt prompt does not match the stored context_hash",
                    execution_id=execution_id,
                    call_id=call_id,
                    field="context_hash",
                )
            verified += 1
    return verified


def tree_counts(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Executions, calls, tree nodes, unique and policy tokens, and trajectories of the store."""
    row = con.execute(
        """SELECT (SELECT count(*) FROM executions), (SELECT count(*) FROM calls), count(*),
                  coalesce(sum(n_tokens), 0), coalesce(sum(n_tokens) FILTER (WHERE is_policy), 0),
                  (SELECT count(*) FROM trajectories)
           FROM tree_nodes"""
    ).fetchall()[0]
    names = ("executions", "calls", "tree_nodes", "unique_tokens", "policy_tokens", "trajectories")
    return dict(zip(names, row, strict=True))
