"""The cell flow's deployment on every host of a ``[cluster]``: ``gyre-cell/<host>`` on the host's pool,
and, when the core has ranks on hosts (``core_hosts``), the core rank's, ``gyre-core-rank/<host>``.

    deploy_cells(cluster)     # the pools (process type) and the deployments of each host

The deployments name the flow by its module path (``flows.cell.cell``), not by a file of this
checkout: a host's worker imports it from the gyrerl installed where the worker runs (``pip install``
of the package or of a checkout, at any path). Nothing is read from the campaign machine's disk.
"""

from __future__ import annotations

from deployments.deploy import ensure_pool
from stack.cell import CELL_FLOW, CORE_RANK_FLOW
from stack.cluster_config import ClusterConfig

ENTRYPOINT = "flows.cell.cell"


def deploy_cells(cluster: ClusterConfig) -> dict[str, str]:
    """host name -> the id of its ``gyre-cell/<host>`` deployment (created or updated)."""
    from prefect.deployments.runner import EntrypointType

    from flows.cell import cell, core_rank

    if (cell.name, core_rank.name) != (CELL_FLOW, CORE_RANK_FLOW):
        raise RuntimeError(f"flows.cell holds the flows {cell.name!r} and {core_rank.name!r}")
    ids = {}
    for host in cluster.hosts:
        ensure_pool(host.pool())
        flows = [(cell, "a cell of the campaign")]
        if cluster.core_hosts:  # on every host: a lost host's rank runs on another
            flows.append((core_rank, "a rank of the campaign's core for one step"))
        for flow, what in flows:
            deployed = flow.deploy(
                host.name,
                work_pool_name=host.pool(),
                description=f"{what} on host {host.name} ({host.address})",
                build=False,
                push=False,
                print_next_steps=False,
                ignore_warnings=True,
                entrypoint_type=EntrypointType.MODULE_PATH,
            )
            if flow is cell:
                ids[host.name] = str(deployed)
    return ids
