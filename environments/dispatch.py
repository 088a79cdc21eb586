"""Dispatch: many executions at once (asyncio + one harness subprocess each), each with a deadline,
graded with partial credit even when it runs out of time.

For every (problem, group member) the dispatcher

1. registers the execution with the gateway (admin API) and gets its base_url and api_key;
2. creates its workspace from the problem's template under the workspace root, with an opaque name
   (nothing in a path names the problem or the execution) and a disk quota; the harness gets the
   problem's public part only (instruction, visible test command), in a side folder outside that root;
3. starts the harness as a subprocess in its own process group: the built-in one
   (``python -m environments.harness``, its tool commands sandboxed one by one) or any external
   command given as a template (``{base_url}``, ``{api_key}``, ``{workspace}``, ``{instruction_file}``;
   OPENAI_BASE_URL / OPENAI_API_KEY are set too; a problem may name its own), started inside the
   execution's sandbox with the gateway as its only reachable address (environments/sandbox_harness.py;
   ``harness_sandbox = false`` runs it on the host); its group is recorded next to the harness
   folder's owner file, so when a dispatcher is SIGKILLed the next one kills its harnesses
   (sweep_dead_dispatchers);
4. at the deadline kills the whole group; the execution is ``timeout``, its workspace is snapshotted
   into the store as Parquet rows (``snapshots/`` + content-addressed ``blobs/``, next to the
   problem's starting workspace; environments/snapshot_rows.py) and graded from what was stored,
   materialised into a fresh sandbox with the tar extraction's refusals
   (``reward_source = workspace_snapshot``); an execution that ended on its own is graded from its
   final workspace (``final``), and with ``snapshot_completed`` that workspace is stored too; a
   harness that exits non-zero is ``error`` (its log is kept under ``logs/``, reward 0 as a
   placeholder);
5. retries a failing grader up to ``grader_retries`` times, then marks the execution ``eval_failed``
   (no reward, never trained on); no artifact at all (no workspace to snapshot) gives a reward-0
   ``placeholder``;
6. finishes the execution through the gateway, which records it next to its calls.

Nothing is dropped silently: every execution ends with exactly one finish, whatever happened.
Execution ids are ``s<step>-<problem>-g<member>``, plus ``-<run_id>`` when DispatchConfig.run_id is
set (`gyre rollout` sets a fresh one per run, so a second run never collides with the first; a
campaign step leaves it unset, so a retried step finds its own executions).

Attempts: a dispatcher that dies (its task retried, the scheduler restarted) leaves its executions
live at the gateway, some of their calls already recorded. A new attempt of the same group member
never reuses that id: it registers ``<id>-a<k>``, the first attempt id with no row in the store
(StepLedger), with a token of its own, and the gateway records a live execution registered under
another token as ``abandoned`` (its calls kept, never graded, never trained on) before refusing it
with 409 ``execution_superseded``, which moves the dispatcher to the next attempt. So the reward of
one attempt is never joined to the calls of another, and a member counts as done once one of its
attempts ended with any status but ``abandoned``.
Durations are heavy-tailed like real xLong work: most executions get a short turn budget, a
configurable fraction gets ``long_factor`` times more (see DurationProfile).

Pieces: dispatch_config.py (DispatchConfig, DurationProfile), runner.py (ExecutionRunner: one
execution, steps 1-6; ExecutionOutcome), ledger.py (StepLedger, the ids of attempts), gateway_admin.py
(GatewayAdmin: the execution admin API), sweep.py (what a dead dispatcher left: its harnesses, mounts and
folders); this module runs a batch of them at once.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from environments.dispatch_config import DispatchConfig
from environments.gateway_admin import GatewayAdmin, GatewayAdminError
from environments.gateways import GatewayPool
from environments.ledger import StepLedger, step_ledger
from environments.problems import Problem
from environments.runner import ExecutionOutcome, ExecutionRunner, MemberEnded
from environments.sweep import own, sweep_dead_dispatchers
from environments.zygote import Zygote
from trajectory_store.storage import Store, StoreConfig

log = logging.getLogger(__name__)


async def dispatch(
    problems: list[Problem],
    gateway_url: str | Sequence[str],
    admin_token: str,
    store: StoreConfig,
    config: DispatchConfig | None = None,
    members: dict[str, list[int]] | None = None,
    on_outcome: Callable[[ExecutionOutcome], None] | None = None,
    ledger: StepLedger | None = None,
    zygote: Zygote | None = None,
) -> list[ExecutionOutcome]:
    """Runs group_size executions of every problem; returns one outcome each (in problem order).

    ``members`` (problem id -> member indices) runs only those members of the problems it names: a
    retried step dispatches what did not finish, never a finished execution again. ``on_outcome`` is
    called with each outcome as its execution finishes (progress). An execution id the gateway has
    already finished (409) starts nothing more: the executions already running end as usual, then
    the GatewayAdminError is raised. ``ledger``: what the store holds of the step (read when None),
    which picks each member's attempt id. ``zygote``: a warm harness launcher the caller keeps
    between batches (a scheduler dispatches one execution at a time); None: one for this batch.
    ``gateway_url``: one gateway, or several (environments/gateways.py: each execution pinned to one by
    its id, with the next standing by)."""
    config = config or DispatchConfig()
    if config.workspace_root:
        root = config.workspace_root
    else:
        sweep_dead_dispatchers()
        root = tempfile.mkdtemp(prefix="gyre-workspaces-")
        own(root)
    Path(root).mkdir(parents=True, exist_ok=True)
    semaphore = asyncio.Semaphore(config.concurrency)
    runner = ExecutionRunner(Store(store), config, root, ledger or step_ledger(store, config.step), zygote)
    refused: list[GatewayAdminError] = []
    try:
        async with httpx.AsyncClient() as client:
            urls = [gateway_url] if isinstance(gateway_url, str) else list(gateway_url)
            admin = (
                GatewayAdmin(urls[0], admin_token, client)
                if len(urls) == 1
                else GatewayPool(urls, admin_token, client)
            )

            async def one(problem: Problem, member: int) -> ExecutionOutcome | None:
                async with semaphore:
                    if refused:
                        return None
                    try:
                        outcome = await runner.run(admin, problem, member)
                    except MemberEnded as ended:  # a dead dispatcher's attempt ended it: never twice
                        log.warning("%s", ended)
                        return None
                    except GatewayAdminError as exc:
                        if exc.status != 409:
                            raise
                        refused.append(exc)
                        return None
                if on_outcome is not None:
                    on_outcome(outcome)
                return outcome

            everyone = list(range(config.group_size))
            jobs = [one(p, m) for p in problems for m in (members or {}).get(p.problem_id, everyone)]
            outcomes = await asyncio.gather(*jobs)
            if refused:
                raise refused[0]
            return [o for o in outcomes if o is not None]
    finally:
        await runner.close()
        if not config.keep_workspaces:
            shutil.rmtree(runner.side_root, ignore_errors=True)
        if not config.workspace_root and not config.keep_workspaces:
            shutil.rmtree(root, ignore_errors=True)


async def dispatch_missing(
    problems: list[Problem],
    gateway_url: str | Sequence[str],
    admin_token: str,
    store: StoreConfig,
    config: DispatchConfig,
    on_outcome: Callable[[ExecutionOutcome], None] | None = None,
) -> tuple[list[ExecutionOutcome], int]:
    """(outcomes, already ended): dispatches the members of ``problems`` that have not ended in the
    store, so a retried step (or a dispatcher run again after one died) never runs a member twice."""
    ledger = step_ledger(store, config.step)
    members = {
        p.problem_id: [m for m in range(config.group_size) if ledger.outcome(p, m, config.run_id) is None]
        for p in problems
    }
    ended = sum(config.group_size - len(m) for m in members.values())
    todo = [p for p in problems if members[p.problem_id]]
    if not todo:
        return [], ended
    outcomes = await dispatch(todo, gateway_url, admin_token, store, config, members, on_outcome, ledger)
    return outcomes, ended
