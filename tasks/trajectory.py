"""Prefect tasks over the trajectory store: import, rebuild trees, select, pack, inspect with SQL
(read-only), check the stored parts.

Each task is named after what it processes, takes typed configs, returns a typed summary and is
safe to retry: every write derives its key from ids, so a retried task rewrites the same objects.
The plain functions behind the tasks (``task.fn``) serve the CLI, which needs no Prefect server.
"""

from __future__ import annotations

import io
from typing import Any

import pyarrow.parquet as pq
from prefect import task
from pydantic import BaseModel

from trajectory_store.config import PackingConfig, SelectionConfig
from trajectory_store.db import connect, read_only_query, tree_counts, verify_prompts
from trajectory_store.interchange import export_jsonl, import_jsonl
from trajectory_store.parts import check_parts, naming_bad_parts, quarantine_parts
from trajectory_store.processor import batch_to_table, pack
from trajectory_store.storage import Store, StoreConfig
from trajectory_store.synth import generate as generate_trace
from trajectory_store.synth import preset, write_jsonl

__all__ = ["PackingConfig", "SelectionConfig", "StoreConfig"]

EXAMPLE_QUERIES = {
    "trajectories per role (selected / all)": """
        SELECT t.role, count(*) AS trajectories, count(s.trajectory_id) AS selected,
               sum(t.n_policy_tokens) AS policy_tokens
        FROM trajectories t
        LEFT JOIN selected_trajectories s USING (execution_id, trajectory_id)
        GROUP BY t.role ORDER BY min(s.rank) NULLS LAST, t.role""",
    "branch points: where the most calls fork off one node": """
        SELECT c.execution_id, p.owner_call_id AS call_id, p.depth + p.n_tokens AS at_depth, count(*) AS branches,
               string_agg(DISTINCT c.role, ',' ORDER BY c.role) AS roles
        FROM tree_nodes c JOIN tree_nodes p
          ON p.execution_id = c.execution_id AND p.node_id = c.parent_node_id
        GROUP BY ALL HAVING count(*) > 1 ORDER BY branches DESC, at_depth DESC LIMIT 5""",
    "training tokens and weights per execution": """
        SELECT execution_id, count(*) AS training_tokens, round(sum(weight), 6) AS weight_sum,
               round(avg(behaviour_logprob), 4) AS mean_behaviour_logprob
        FROM training_tokens GROUP BY ALL ORDER BY execution_id""",
}


class ImportSummary(BaseModel):
    path: str
    executions: int
    calls: int
    naive_tokens: int
    unique_tokens: int
    quarantined: int
    unchanged: int  # records the store already held exactly (a re-import): not written again
    errors: list[str]


class TreeSummary(BaseModel):
    executions: int
    calls: int
    prompts_verified: int
    tree_nodes: int
    unique_tokens: int
    policy_tokens: int
    trajectories: int


class SelectionSummary(BaseModel):
    selected: int
    by_role: dict[str, int]
    training_tokens: int


class PackSummary(BaseModel):
    step: int
    sequences: int
    tokens: int
    target_tokens: int
    repeated_tokens: int
    uri: str
    skipped: dict[str, str]


class QueryResult(BaseModel):
    columns: list[str]
    rows: list[list[Any]]


@task(name="import-trace", task_run_name="import {path}", retries=2, retry_delay_seconds=1)
def import_trace(path: str, store: StoreConfig, step: int | None = None) -> ImportSummary:
    return ImportSummary.model_validate(import_jsonl(Store(store), path, step), from_attributes=True)


@task(name="export-trace", task_run_name="export {store.campaign} to {out_path}", retries=2)
def export_trace(store: StoreConfig, out_path: str) -> dict[str, int]:
    return export_jsonl(Store(store), out_path)


@task(name="rebuild-trees", task_run_name="rebuild trees of {store.campaign}", retries=1)
def rebuild_trees(store: StoreConfig, selection: SelectionConfig) -> TreeSummary:
    """Rebuilds every call's prompt (checked against context_hash) and counts the trees."""
    target = Store(store)
    con = connect(target, selection)
    with naming_bad_parts(target):
        return TreeSummary(prompts_verified=verify_prompts(con), **tree_counts(con))


@task(name="select-trajectories", task_run_name="select trajectories of {store.campaign}")
def select_trajectories(store: StoreConfig, selection: SelectionConfig) -> SelectionSummary:
    target = Store(store)
    con = connect(target, selection)
    with naming_bad_parts(target):
        by_role = dict(
            con.sql("SELECT role, count(*) FROM selected_trajectories GROUP BY ALL ORDER BY 1").fetchall()
        )
        tokens = con.execute("SELECT count(*) FROM training_tokens").fetchall()[0][0]
    return SelectionSummary(selected=sum(by_role.values()), by_role=by_role, training_tokens=tokens)


@task(name="pack-step", task_run_name="pack step {step} of {store.campaign}", retries=2)
def pack_step(
    store: StoreConfig, selection: SelectionConfig, packing: PackingConfig, step: int
) -> PackSummary:
    """Packs one step's training trees and writes them to batches/step=<n>/packed.parquet."""
    target = Store(store)
    with naming_bad_parts(target):
        batch = pack(connect(target, selection, steps=[step]), packing, step=step)
    buffer = io.BytesIO()
    pq.write_table(batch_to_table(batch, step), buffer, compression=store.compression)
    path = target.path(f"batches/step={step}/packed.parquet")
    target.write_bytes(path, buffer.getvalue())
    return PackSummary(
        step=step,
        sequences=len(batch.sequences),
        tokens=batch.n_tokens,
        target_tokens=batch.n_target_tokens,
        repeated_tokens=batch.n_repeated_tokens,
        uri=target.url(path),
        skipped=batch.skipped,
    )


@task(name="execution-stats", task_run_name="stats of {store.campaign}")
def execution_stats(store: StoreConfig, selection: SelectionConfig) -> QueryResult:
    return run_sql.fn(store, selection, "SELECT * FROM execution_stats")


@task(name="run-sql", task_run_name="sql on {store.campaign}")
def run_sql(store: StoreConfig, selection: SelectionConfig, sql: str) -> QueryResult:
    """Runs queries over the views, read-only: any statement that could change something is refused."""
    target = Store(store)
    con = connect(target, selection, read_only=True)
    with naming_bad_parts(target):
        relation = read_only_query(con, sql)
        if relation is None:  # never for a query; kept so a result-less statement cannot crash
            return QueryResult(columns=[], rows=[])
        return QueryResult(columns=list(relation.columns), rows=[list(r) for r in relation.fetchall()])


class PartProblemSummary(BaseModel):
    kind: str
    part: str
    url: str
    reason: str


class CheckSummary(BaseModel):
    parts: dict[str, int]  # parts read per dataset
    problems: list[PartProblemSummary]  # the unreadable ones
    quarantined: dict[str, str | None]  # part -> where it was moved (None: it was missing)


@task(name="check-store", task_run_name="check the parts of {store.campaign}")
def check_store(store: StoreConfig, quarantine: bool = False) -> CheckSummary:
    """Reads every visible part whole; with ``quarantine``, moves unreadable parts aside."""
    target = Store(store)
    problems, counts = check_parts(target)
    moved = quarantine_parts(target, problems) if quarantine else []
    return CheckSummary(
        parts=counts,
        problems=[PartProblemSummary(kind=p.kind, part=p.part, url=p.url, reason=p.reason) for p in problems],
        quarantined={entry["part"]: entry["moved_to"] for entry in moved},
    )


@task(name="example-queries", task_run_name="example queries on {store.campaign}")
def example_queries(store: StoreConfig, selection: SelectionConfig) -> dict[str, QueryResult]:
    return {title: run_sql.fn(store, selection, sql) for title, sql in EXAMPLE_QUERIES.items()}


@task(name="write-synthetic-trace", task_run_name="synthesize {preset_name} trace to {out_path}")
def write_synthetic_trace(preset_name: str, out_path: str) -> int:
    return write_jsonl(generate_trace(preset(preset_name)), out_path)


def bundled_sample_trace() -> str:
    """The small sample trace shipped in the repository (made by `gyre traj sample`)."""
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1] / "data" / "sample_trace.jsonl")
