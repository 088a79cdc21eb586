"""The cell flow's deployment on every host of a ``[cluster]``: ``gyre-cell/<host>`` on the host's pool.

    deploy_cells(cluster)     # the pools (process type) and one deployment per host

Like deployments/deploy.py, the flow is loaded from this checkout (``Flow.from_source``): each host's
worker runs it from the same path, so every host needs the checkout (or the installed package) there.
"""

from __future__ import annotations

from deployments.deploy import ROOT, ensure_pool
from tasks.services.cluster import CELL_FLOW, ClusterConfig

ENTRYPOINT = "flows/cell.py:cell"


def deploy_cells(cluster: ClusterConfig) -> dict[str, str]:
    """host name -> the id of its ``gyre-cell/<host>`` deployment (created or updated)."""
    from prefect import Flow

    ids = {}
    for host in cluster.hosts:
        ensure_pool(host.pool())
        flow = Flow.from_source(source=str(ROOT), entrypoint=ENTRYPOINT)
        if flow.name != CELL_FLOW:
            raise RuntimeError(f"{ENTRYPOINT} is the flow {flow.name!r}, not {CELL_FLOW!r}")
        ids[host.name] = str(
            flow.deploy(
                host.name,
                work_pool_name=host.pool(),
                description=f"a cell of the campaign on host {host.name} ({host.address})",
                build=False,
                push=False,
                print_next_steps=False,
                ignore_warnings=True,
            )
        )
    return ids
