"""The store demo flow that `gyre run` (and `make run`) runs until the RL campaign exists.

    gyre run [--config configs/demo.toml]

One Prefect flow, four tasks in a row: import the bundled sample trace, rebuild and verify every
execution's tree, select trajectories by role priority, pack step 0 for the trainer; then the
per-execution stats and a few example SQL queries. It returns them all (DemoSummary); `gyre run` prints
them (cli/main.py).
"""

from __future__ import annotations

from prefect import flow
from pydantic import BaseModel

from flows.config import CampaignConfig
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

    return DemoSummary(
        imported=imported, trees=trees, selection=selection, packed=packed, stats=stats, examples=examples
    )
