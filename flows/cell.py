"""One cell of a campaign on its host: a long-lived flow run of the host's `gyre-cell` deployment;
and one rank of the core for one step (`gyre-core-rank`), on a host of ``[cluster] core_hosts``.

A host's process worker runs it (`gyre worker --pool gyre-<host>`); stack/fleet.py
(``CellFleet``) starts, watches and replaces these runs through the Prefect API, and says what a cell
does. The run is the cell in the UI: Running while its engine serves, Cancelled when the campaign
stops it, Crashed (with the reason) when its host was lost and the cell moved elsewhere.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.blocks.system import Secret
from prefect.runtime import flow_run

from stack.cell import TOKENS_BLOCK, run_ended, serve_cell
from stack.serving import ServingConfig
from tasks.train import TrainStepRequest, run_core_rank


@flow(name="gyre-cell", log_prints=True)
def cell(
    cell_id: str,
    host: str,
    address: str,
    policy: str,
    gateway_url: str,
    serving: dict[str, Any] | None = None,
    tokens_block: str = TOKENS_BLOCK,
    weights: str | None = None,
    version: int = 0,
    threads: int | None = None,
    devices: list[int] | None = None,
    more_gateways: list[str] | None = None,
    replica: bool = False,
    cpus: float | None = None,
) -> dict[str, Any]:
    """Serves the cell's engine on ``address`` behind the gateway until the run is cancelled or
    marked crashed; the admin tokens come from the Secret block ``tokens_block``. ``weights``: the
    campaign's current version (``version``), loaded before the engine joins the gateway; ``threads``
    and ``devices``: the engine's torch threads and GPUs (the host's, from ``[cluster]``);
    ``more_gateways``: the campaign's other gateways, which the engine joins too; ``replica``: the cell
    also serves a trainer replica beside its engine (the elastic scheduler's cells); ``cpus``: the
    cell's CPU quota in cores (a cgroup on its host: [cluster] cell_cpus)."""
    tokens = Secret.load(tokens_block).get()
    run_id = flow_run.get_id()
    return serve_cell(
        cell_id,
        host,
        address,
        policy,
        gateway_url,
        ServingConfig(**(serving or {})),
        tokens["admin_token"],
        tokens["engine_admin_token"],
        should_stop=lambda: run_ended(run_id) if run_id else None,
        weights=weights,
        version=version,
        threads=threads,
        gpus=devices,
        more_gateways=more_gateways or (),
        replica=replica,
        cpus=cpus,
    )


@flow(name="gyre-core-rank", log_prints=True)
def core_rank(request: dict[str, Any], rank: int, address: str) -> dict[str, Any]:
    """Rank ``rank`` of a step's core on this host (``address``: the host's address on the cluster
    network), for that one step: the campaign's train task starts one per host of ``[cluster]
    core_hosts`` beside its trainer, which is rank 0 (tasks/train.py). ``request``: the step's
    TrainStepRequest as JSON."""
    report = run_core_rank(TrainStepRequest.model_validate(request), rank, address)
    print(
        f"core rank {rank} made {report['updates']} updates of step {report['step'] - 1}, holding "
        f"{report['optimizer_state_bytes']} bytes of optimizer state"
    )
    return report
