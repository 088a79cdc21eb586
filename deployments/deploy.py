"""The scheduled campaigns of deployments/prefect.yaml: read, checked, registered, and run by a worker.

    gyre deploy [--file deployments/prefect.yaml]    # the work pool and the deployments, on the server
    gyre worker [--pool gyre]                        # a process worker that runs their flow runs

``register`` creates the process work pool if it is missing, checks every deployment (its entrypoint
loads, its parameters make a valid CampaignConfig, its schedules parse) and registers it with
``flow.from_source(<this checkout>, entrypoint).deploy(...)``, so a worker on this machine runs the
flows from this checkout. The same file also works with Prefect's own CLI from the checkout's root:
``prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml``.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILE = ROOT / "deployments" / "prefect.yaml"


@dataclass
class DeploymentSpec:
    name: str
    entrypoint: str
    pool: str
    parameters: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    schedules: list[Any] = field(default_factory=list)  # prefect.schedules.Schedule


def read_specs(path: str | Path = DEFAULT_FILE) -> list[DeploymentSpec]:
    """The deployments of a prefect.yaml, with their schedules parsed (ValueError names what is wrong)."""
    from prefect.schedules import Cron

    text = Path(path).read_text()
    data = yaml.safe_load(text) or {}
    specs = []
    for index, entry in enumerate(data.get("deployments") or []):
        where = f"{path}: deployment {entry.get('name', index)!r}"
        try:
            schedules = [
                Cron(s["cron"], timezone=s.get("timezone", "UTC")) for s in entry.get("schedules") or []
            ]
            specs.append(
                DeploymentSpec(
                    name=entry["name"],
                    entrypoint=entry["entrypoint"],
                    pool=entry["work_pool"]["name"],
                    parameters=entry.get("parameters") or {},
                    description=entry.get("description", ""),
                    schedules=schedules,
                )
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: missing or malformed field {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if not specs:
        raise ValueError(f"{path} lists no deployments")
    return specs


def check(spec: DeploymentSpec) -> None:
    """The entrypoint loads as a flow and the parameters make a valid campaign config."""
    from prefect.flows import load_flow_from_entrypoint

    from flows.config import CampaignConfig

    file, _, name = spec.entrypoint.partition(":")
    flow = load_flow_from_entrypoint(f"{ROOT / file}:{name}")
    flow.validate_parameters(spec.parameters)
    if "config_path" in spec.parameters:
        config = CampaignConfig.from_toml(ROOT / spec.parameters["config_path"])
        config.merged(spec.parameters.get("overrides") or {})


def ensure_pool(name: str) -> bool:
    """Creates the process work pool ``name`` if the server has none; True if it was created."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
            return True


def register(path: str | Path = DEFAULT_FILE) -> dict[str, str]:
    """Checks and registers every deployment of ``path``; returns name -> deployment id."""
    from prefect import Flow

    specs = read_specs(path)
    for spec in specs:
        check(spec)
    ids = {}
    for spec in specs:
        ensure_pool(spec.pool)
        flow = Flow.from_source(source=str(ROOT), entrypoint=spec.entrypoint)
        deployment_id = flow.deploy(
            spec.name,
            work_pool_name=spec.pool,
            parameters=spec.parameters,
            schedules=spec.schedules,
            description=spec.description,
            build=False,
            push=False,
            print_next_steps=False,
        )
        ids[f"{flow.name}/{spec.name}"] = str(deployment_id)
    return ids


def worker_command(pool: str = "gyre") -> list[str]:
    """``prefect worker start`` for the pool, with this environment's prefect."""
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
    return [prefect, "worker", "start", "--pool", pool, "--type", "process"]
