"""The store's Parquet parts one by one: what `gyre traj check` runs, and how a failed query
learns which part broke it.

    problems, counts = check_parts(store)      # every committed part, read whole
    quarantine_parts(store, problems)          # moved under quarantine/parts/, never deleted

A query reads all of a dataset's parts at once, so one corrupt part fails every query, and DuckDB's
error often names no file ("invalid TType"). ``check_part`` reads one part whole, twice: with DuckDB,
the reader every query uses, and with pyarrow verifying page checksums (storage.write_part writes
them), which finds flipped bits inside a page that still decodes. A part that fails either, that a
manifest lists but storage lacks, or whose rows this gyrerl cannot use (another schema_version, a
required value missing) is a PartProblem. ``quarantine_parts`` moves such a part under
``quarantine/parts/`` with a .json saying why; Store.visible_parts then leaves it out, so the rest
stays queryable. ``naming_bad_parts`` wraps a read: a DuckDB error that a bad part can cause becomes a
StoreError naming the part and the way out.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from trajectory_store.schema import SCHEMA_VERSION, SCHEMAS
from trajectory_store.storage import KINDS, QUARANTINED_PARTS, Store, StoreError

# What every stored row must hold (the Parquet files are read as they are): db.py checks these
# over all parts when a connection opens, check_part over one part.
REQUIRED_COLUMNS = {
    "calls": (
        "execution_id",
        "call_id",
        "role",
        "prefix_len",
        "new_ids",
        "prompt_len",
        "output_len",
        "context_hash",
    ),
    "executions": ("execution_id", "status"),
    "metrics": ("step", "name", "value"),
    "snapshots": ("snapshot_id", "source", "path", "kind", "mode", "size"),
    "blobs": ("sha256", "size"),  # not data: the check at connect must not read every blob
}

# DuckDB errors that an unreadable part can cause; a bare duckdb.Error ("invalid TType") too. Errors
# in the user's SQL (parser, binder, catalog, conversion) never send us reading every part.
_READ_ERRORS = (
    duckdb.IOException,
    duckdb.InvalidInputException,
    duckdb.InternalException,
    duckdb.SerializationException,
)


@dataclass(frozen=True)
class PartProblem:
    """One committed part that stops queries, and why."""

    kind: str
    part: str  # relative to the campaign folder, as manifests list it
    url: str  # what DuckDB opens: a path locally, s3://… otherwise
    reason: str
    missing: bool = False  # listed by a manifest, absent from storage


def bare_connection(store: Store, *, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """DuckDB over the store's filesystem, extension downloads off, no views."""
    config = {"autoinstall_known_extensions": "false", "autoload_known_extensions": "false"}
    if threads:
        config["threads"] = str(threads)
    if store.config.duckdb_memory_limit:
        config["memory_limit"] = store.config.duckdb_memory_limit.strip()
    if store.config.duckdb_temp_directory:
        config["temp_directory"] = store.config.duckdb_temp_directory
    con = duckdb.connect(":memory:", config=config)
    if not store.is_local:
        # s3:// (and any other fsspec protocol) is read through the store's own filesystem object,
        # so DuckDB uses the same endpoint and credentials and never needs the httpfs extension.
        con.register_filesystem(store.fs)
    return con


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]


def rows_problem(table: pa.Table, kind: str) -> str | None:
    """Why this gyrerl cannot use a part's rows, or None."""
    missing = [name for name in SCHEMAS[kind].names if name not in table.column_names]
    if missing:
        return f"lacks columns {missing}"
    versions = set(table.column("schema_version").to_pylist())
    if versions - {SCHEMA_VERSION}:
        return f"schema_version {sorted(versions)}, this gyrerl reads {SCHEMA_VERSION}"
    nulls = [name for name in REQUIRED_COLUMNS.get(kind, ()) if table.column(name).null_count]
    if nulls:
        return f"rows missing {', '.join(nulls)}"
    return None


def check_part(store: Store, con: duckdb.DuckDBPyConnection, kind: str, path: str) -> str | None:
    """Reads one part whole; returns why it is unusable, or None when it reads."""
    if not store.exists(path):
        return "missing: a manifest lists it, storage does not have it"
    try:
        data = store.read_bytes(path)
        table = pq.read_table(io.BytesIO(data), page_checksum_verification=True)
    except (OSError, pa.ArrowException) as error:
        return _first_line(error)
    problem = rows_problem(table, kind)
    if problem:
        return problem
    try:
        url = "'" + store.url(path).replace("'", "''") + "'"
        result = con.sql(f"SELECT * FROM read_parquet({url})").arrow()
        # a reader in DuckDB 2 (one batch at a time), a table before: either way every page decodes
        for _ in result if hasattr(result, "read_next_batch") else result.to_batches():
            pass
    except duckdb.Error as error:
        return _first_line(error)
    return None


def check_parts(store: Store, kinds: tuple[str, ...] = KINDS) -> tuple[list[PartProblem], dict[str, int]]:
    """Every visible part of the campaign, read whole: (the problems, how many parts per kind)."""
    con = bare_connection(store)
    problems: list[PartProblem] = []
    counts: dict[str, int] = {}
    for kind in kinds:
        paths = store.visible_parts(kind)
        counts[kind] = len(paths)
        for path in paths:
            reason = check_part(store, con, kind, path)
            if reason is not None:
                problems.append(_problem(store, kind, path, reason))
    return problems, counts


def read_parts(store: Store, kind: str, paths: list[str]) -> pa.Table:
    """Parts of one dataset read whole and at once (object storage fetches them concurrently), as
    DuckDB's read_parquet(union_by_name, filename) gives them: the dataset's columns, null where a
    part lacks one, and ``filename``, each row's part URL. A part that is absent or does not decode
    is a StoreError naming it, as a failed query's is."""
    schema = SCHEMAS[kind]
    fetched = store.fs.cat(paths, on_error="return") if paths else {}
    tables = []
    for path in paths:
        data = fetched.get(path, FileNotFoundError(path))
        reason = None
        if isinstance(data, FileNotFoundError):
            reason = "missing: a manifest lists it, storage does not have it"
        else:
            try:
                if isinstance(data, BaseException):
                    raise data
                table = pq.read_table(io.BytesIO(data))
                empty = {f.name: pa.nulls(table.num_rows, f.type) for f in schema}
                table = pa.table(
                    {**empty, **{n: table.column(n) for n in schema.names if n in table.column_names}}
                )
                table = table.select(schema.names).cast(schema)
            except (OSError, pa.ArrowException) as error:
                reason = _first_line(error)
        if reason is not None:
            raise _unreadable(_problem(store, kind, path, reason), 0)
        tables.append(
            table.append_column("filename", pa.array([store.url(path)] * table.num_rows, pa.string()))
        )
    if not tables:
        return schema.empty_table().append_column("filename", pa.array([], pa.string()))
    return pa.concat_tables(tables)


def _problem(store: Store, kind: str, path: str, reason: str) -> PartProblem:
    rel = path[len(store.campaign_dir) + 1 :]
    return PartProblem(kind, rel, store.url(path), reason, missing=reason.startswith("missing:"))


def quarantine_parts(store: Store, problems: list[PartProblem]) -> list[dict]:
    """Moves each problem part under quarantine/parts/ (never deletes it); returns the records.

    Each part is checked again first (a part that now reads stays). The record is written before
    the move: a crash between the two leaves the part where it was, still visible, and a second run
    repeats the move to the same name (the name holds the content's hash, so nothing is overwritten).
    A missing part gets a record only, which is what hides it from the views.
    """
    con = bare_connection(store)
    done = []
    for problem in problems:
        source = store.path(problem.part)
        reason = check_part(store, con, problem.kind, source)
        if reason is None:
            continue
        stem = problem.part.removesuffix(".parquet")
        entry = {**asdict(problem), "reason": reason, "moved_to": None, "bytes": None, "sha256": None}
        if problem.missing or not store.exists(source):
            entry["missing"] = True
            record = f"{QUARANTINED_PARTS}/{stem}.missing.json"
        else:
            digest = hashlib.sha256(store.read_bytes(source)).hexdigest()
            entry.update(
                moved_to=f"{QUARANTINED_PARTS}/{stem}.{digest[:12]}.parquet",
                bytes=store.fs.size(source),
                sha256=digest,
            )
            record = f"{QUARANTINED_PARTS}/{stem}.{digest[:12]}.json"
        store.write_bytes(store.path(record), json.dumps(entry, sort_keys=True).encode())
        if entry["moved_to"]:
            store.move(source, store.path(entry["moved_to"]))
        done.append(entry)
    return done


def explain_read_error(store: Store, error: BaseException) -> StoreError | None:
    """A StoreError naming the part behind a failed read, or None when every part reads."""
    con = bare_connection(store)
    message = str(error)
    for kind in KINDS:  # the part DuckDB named, when it did, first: one read instead of all
        for path in store.visible_parts(kind):
            if store.url(path) in message:
                reason = check_part(store, con, kind, path)
                if reason is not None:
                    return _unreadable(_problem(store, kind, path, reason), 0)
    problems, _ = check_parts(store)
    if not problems:
        return None
    return _unreadable(problems[0], len(problems) - 1)


def _unreadable(problem: PartProblem, more: int) -> StoreError:
    others = f" (and {more} more part{'s' if more > 1 else ''})" if more else ""
    return StoreError(
        f"{problem.url}: unreadable {problem.kind} part{others}: {problem.reason}; "
        "`gyre traj check` lists unreadable parts, `gyre traj check --quarantine` moves them aside "
        "so the rest stays queryable"
    )


@contextmanager
def naming_bad_parts(store: Store) -> Iterator[None]:
    """Turns a DuckDB read error caused by a bad part into a StoreError that names the part."""
    try:
        yield
    except duckdb.Error as error:
        if type(error) is not duckdb.Error and not isinstance(error, _READ_ERRORS):
            raise
        named = explain_read_error(store, error)
        if named is None:
            raise
        raise named from error
