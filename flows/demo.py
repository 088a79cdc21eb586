"""The store demo flow that `gyre run` (and `make run`) runs until the RL campaign exists.

    gyre run [--config configs/demo.toml]

One Prefect flow, four tasks in a row: import the bundled sample trace, rebuild and verify every
execution's tree, select trajectories by role priority, pack step 0 for the trainer; then it
prints the per-execution stats and the results of a few example SQL queries.
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from flows.config import CampaignConfig
from flows.format import render
from tasks.trajectory import (
    ImportSummary,
    PackSummary,
    QueryResult,
    SelectionSummary,
    TreeSummary,
    bundled_sample_trace,
    example_queries,
    execution_stats,
    import_trace,
    pack_step,
    rebuild_trees,
    select_trajectories,
)


class DemoSummary(BaseModel):
    imported: ImportSummary
    trees: TreeSummary
    selection: SelectionSummary
    packed: PackSummary
    stats: QueryResult
    examples: dict[str, QueryResult]


@flow(name="store-demo", flow_run_name="store demo: {config.name}")
def store_demo(config: CampaignConfig) -> DemoSummary:
    trace = config.trace or bundled_sample_trace()
    imported = import_trace(trace, config.store, step=0)
    trees = rebuild_trees(config.store, config.selection, wait_for=[imported])
    selection = select_trajectories(config.store, config.selection, wait_for=[trees])
    packed = pack_step(config.store, config.selection, config.packing, step=0, wait_for=[selection])
    stats = execution_stats(config.store, config.selection, wait_for=[packed])
    examples = example_queries(config.store, config.selection, wait_for=[packed])

    print(
        f"imported {imported.executions} executions and {imported.calls} calls from {imported.path}: "
        f"{imported.naive_tokens} tokens as sent, {trees.unique_tokens} unique "
        f"({imported.naive_tokens / max(trees.unique_tokens, 1):.1f}x), {imported.quarantined} quarantined"
    )
    print(
        f"trees: {trees.tree_nodes} nodes, {trees.policy_tokens} policy tokens, {trees.trajectories} trajectories; "
        f"{trees.prompts_verified} prompts rebuilt and verified against context_hash"
    )
    print(
        f"selected {selection.selected} trajectories {selection.by_role}, {selection.training_tokens} training tokens"
    )
    print(
        f"packed step 0: {packed.sequences} sequences, {packed.tokens} tokens ({packed.target_tokens} targets, "
        f"{packed.repeated_tokens} repeated ancestors) -> {packed.uri}"
    )
    print("\nper execution:\n" + render(stats.columns, stats.rows))
    for title, result in examples.items():
        print(f"\n{title}:\n" + render(result.columns, result.rows))
    return DemoSummary(
        imported=imported, trees=trees, selection=selection, packed=packed, stats=stats, examples=examples
    )
