"""Zombie flow runs: a campaign process that dies (SIGKILL, the machine lost) leaves its flow run
RUNNING forever, since open-source Prefect has no zombie detection of its own (PREFECT-NOTES.md).

gyrerl's flow processes beat (PREFECT_FLOWS_HEARTBEAT_FREQUENCY = HEARTBEAT_S, set by `gyre run`,
`gyre campaign` and the deployments' workers), and `gyre up` installs one automation on the server
it starts (or the one PREFECT_API_URL names): a flow run that has beaten once and then says nothing
for SILENT_S seconds (10 minutes), without reaching a final state, is set CRASHED. A crashed campaign is then one
Retry in the UI (or the same `gyre run --name`) away from resuming after its last committed step.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

HEARTBEAT_S = 30
"""Seconds between a flow run's heartbeats (Prefect's minimum)."""
SILENT_S = 600
"""Seconds without a heartbeat after which a running flow run is a zombie. Any flow run on the
server may beat at Prefect's default of every 180 s (a script of the user's, not started by gyre),
so this must stay well above that: 600 s is three default beats missed (twenty of gyre's)."""
AUTOMATION_NAME = "gyre: crash flow runs whose process died"


def heartbeat_env() -> dict[str, str]:
    """What a flow process needs in its environment to beat."""
    return {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}


def zombie_automation(silent_s: float = SILENT_S):
    """The automation (Prefect's documented recipe for self-hosted servers)."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    ending = ("Completed", "Failed", "Cancelled", "Crashed")
    return Automation(
        name=AUTOMATION_NAME,
        description=f"a running flow run silent for {silent_s:g} s after a heartbeat is marked Crashed",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{state}" for state in ending)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silent_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {silent_s:g} s: the flow's process died (gyre zombie detection)",
            )
        ],
    )


async def ensure_zombie_automation(silent_s: float = SILENT_S) -> str:
    """Creates the automation on the current PREFECT_API_URL's server unless one of that name
    exists; returns its id."""
    from prefect.automations import Automation

    try:
        return str((await Automation.aread(name=AUTOMATION_NAME)).id)
    except ValueError:  # not there yet
        return str((await zombie_automation(silent_s).acreate()).id)


def install(silent_s: float = SILENT_S) -> str:
    return asyncio.run(ensure_zombie_automation(silent_s))
