"""The cell flow's deployment on every host of a ``[cluster]``: ``gyre-cell/<host>`` on the host's pool.

    deploy_cells(cluster)     # the pools (process type) and one deployment per host

The deployments name the flow by its module path (``flows.cell.cell``), not by a file of this
checkout: a host's worker imports it from the gyrerl installed where the worker runs (``pip install``
of the package or of a checkout, at any path). Nothing is read from the campaign machine's disk.
"""

from __future__ import annotations

from deployments.deploy import ensure_pool
from tasks.services.cluster import CELL_FLOW, ClusterConfig

ENTRYPOINT = "flows.cell.cell"


def deploy_cells(cluster: ClusterConfig) -> dict[str, str]:
    """host name -> the id of its ``gyre-cell/<host>`` deployment (created or updated)."""
    from prefect.deployments.runner import EntrypointType

    from flows.cell import cell

    if cell.name != CELL_FLOW:
        raise RuntimeError(f"{ENTRYPOINT} is the flow {cell.name!r}, not {CELL_FLOW!r}")
    ids = {}
    for host in cluster.hosts:
        ensure_pool(host.pool())
        ids[host.name] = str(
            cell.deploy(
                host.name,
                work_pool_name=host.pool(),
                description=f"a cell of the campaign on host {host.name} ({host.address})",
                build=False,
                push=False,
                print_next_steps=False,
                ignore_warnings=True,
                entrypoint_type=EntrypointType.MODULE_PATH,
            )
        )
    return ids
