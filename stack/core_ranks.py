"""The core's ranks above 0 on the hosts of ``[cluster]``: a flow run of ``gyre-core-rank/<host>``
each, for one step (flows/cell.py runs engines/train/peer.py there); started, waited for and
cancelled by the train task (tasks/train.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Sequence
from typing import Any

from stack.cell import CORE_RANK_FLOW
from stack.cluster_config import ClusterConfig


def start_core_ranks(
    cluster: ClusterConfig, request: dict[str, Any], step: int, lost: Collection[str] = ()
) -> list[str]:
    """A flow run of ``gyre-core-rank/<host>`` for each core rank above 0, on its host of
    ``cluster.core_rank_hosts(lost)``, each joining the core of ``request`` (a TrainStepRequest as
    JSON) for step ``step``; their ids."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    runs = []
    with get_client(sync_client=True) as client:
        for rank, name in enumerate(cluster.core_rank_hosts(lost), start=1):
            try:
                deployment = client.read_deployment_by_name(f"{CORE_RANK_FLOW}/{name}")
            except ObjectNotFound:
                raise RuntimeError(
                    f"core rank {rank}: the server has no deployment {CORE_RANK_FLOW}/{name}: register the "
                    "cluster's deployments first (`gyre deploy --cells <campaign.toml>`)"
                ) from None
            run = client.create_flow_run_from_deployment(
                deployment.id,
                parameters={"request": request, "rank": rank, "address": cluster.host(name).address},
                name=f"core-rank-{rank}-step-{step}-on-{name}",
            )
            runs.append(str(run.id))
    return runs


def wait_core_ranks(run_ids: Sequence[str], timeout_s: float = 120.0) -> None:
    """Waits until the core ranks' flow runs have ended; raises RuntimeError naming any that did not
    complete (rank 0 has its step by then: a rank that failed after it would have failed it too)."""
    from prefect import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        for run_id in run_ids:
            while True:
                run = client.read_flow_run(run_id)
                if run.state is not None and run.state.is_final():
                    if not run.state.is_completed():
                        raise RuntimeError(
                            f"core rank {run.name} ended {run.state.name}: {run.state.message}"
                        )
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"core rank {run.name} has not ended within {timeout_s:.0f} s")
                time.sleep(0.5)


def cancel_core_ranks(run_ids: Sequence[str]) -> None:
    """Cancels the core ranks' runs that have not ended (rank 0 failed: a retry starts new ones)."""
    from prefect import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        for run_id in run_ids:
            with contextlib.suppress(Exception):
                if not client.read_flow_run(run_id).state.is_final():
                    client.set_flow_run_state(run_id, Cancelling(message="rank 0 of the core failed"))
