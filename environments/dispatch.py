"""Dispatch: many executions at once (asyncio + one harness subprocess each), each with a deadline,
graded with partial credit even when it runs out of time.

For every (problem, group member) the dispatcher

1. registers the execution with the gateway (admin API) and gets its base_url and api_key;
2. creates its workspace from the problem's template under the workspace root, with an opaque name
   (nothing in a path names the problem or the execution) and a disk quota; the harness gets the
   problem's public part only (instruction, visible test command), in a side folder outside that root;
3. starts the harness as a subprocess in its own process group: the built-in one
   (``python -m environments.harness``) or any external command given as a template (``{base_url}``,
   ``{api_key}``, ``{workspace}``, ``{instruction_file}``; OPENAI_BASE_URL / OPENAI_API_KEY are set too);
   its group is recorded next to the harness folder's owner file, so when a dispatcher is SIGKILLed
   the next one kills its harnesses (sweep_dead_dispatchers);
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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from environments.harness import HarnessConfig
from environments.problems import GraderError, GradeResult, Problem, grade_workspace
from environments.sandbox import Sandbox, release_mounts
from environments.snapshot import UnsafeArchive
from environments.snapshot_rows import sandbox_from_stored, store_workspace
from environments.zygote import Zygote, ZygoteLost
from trajectory_store.schema import RewardSource, Status
from trajectory_store.snapshots import SnapshotStore
from trajectory_store.storage import Store, StoreConfig, StoreError

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 8
"""Attempts of one member superseded in a row before the dispatcher gives up (two dispatchers on one
step would supersede each other's attempts)."""


@dataclass
class DurationProfile:
    """Heavy-tailed execution lengths: most short, ``long_fraction`` of them 10-50x longer."""

    short_turns: int = 3
    """Turn budget of a short execution."""
    long_fraction: float = 0.2
    """Fraction of executions that are long."""
    long_factor: tuple[float, float] = (10.0, 50.0)
    """A long execution gets short_turns times a factor drawn uniformly from this range."""

    def turns(self, execution_id: str) -> int:
        rng = random.Random(hashlib.md5(execution_id.encode()).hexdigest())
        if rng.random() < self.long_fraction:
            return max(1, round(self.short_turns * rng.uniform(*self.long_factor)))
        return self.short_turns


@dataclass
class DispatchConfig:
    """How a batch of executions runs."""

    step: int = 0
    group_size: int = 1
    """Executions per problem (one GRPO group)."""
    concurrency: int = 4
    """Executions running at once."""
    timeout_s: float = 120.0
    """Deadline of one execution (harness wall clock); then snapshot + grade."""
    grader_retries: int = 2
    """Extra attempts of a failing grader before the execution is eval_failed."""
    grade_timeout_s: float = 60.0
    durations: DurationProfile = field(default_factory=DurationProfile)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    harness_command: list[str] | None = None
    """An external harness: argv template with {base_url} {api_key} {workspace} {instruction_file};
    None runs the built-in harness."""
    harness_name: str | None = None
    """Recorded in executions.harness (default: 'builtin' or the command's program name)."""
    workspace_root: str | None = None
    """Where workspaces go (default: a fresh temporary folder, removed at the end)."""
    keep_workspaces: bool = False
    workspace_disk_bytes: int | None = 512 << 20
    """Disk quota of each workspace (a tmpfs of this size; None: a plain folder, no quota)."""
    workspace_files: int = 50_000
    """Files and folders a workspace may hold (with a quota)."""
    run_id: str | None = None
    """Appended to every execution and group id (s0-p-g0-<run_id>), so a second run of the same
    problems at the same step makes new executions; None: ids are (step, problem, member) alone,
    the same for a retried step (retry-safe)."""
    campaign: str | None = None
    """Record the executions in this campaign of the gateway's data root (None: the gateway's own);
    a held-out evaluation beside a training campaign uses one."""
    harness_zygote: bool = True
    """Start the built-in harness by forking a process that imported it once (environments/zygote.py):
    the same process, session and environment as ``python -m environments.harness``, without its
    ~1.2 s of CPU for imports per execution. False: a fresh interpreter per execution."""
    snapshot_completed: bool = False
    """Also store the final workspace of every completed execution (source 'final' in the snapshots
    dataset), so `gyre sql` can compare it with timed-out ones; timeouts are always snapshotted."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DispatchConfig:
        data = dict(data)
        durations = data.pop("durations", None)
        harness = data.pop("harness", None)
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown dispatch config fields {sorted(unknown)}")
        return cls(
            **data,
            durations=DurationProfile(**durations) if isinstance(durations, dict) else DurationProfile(),
            harness=HarnessConfig.from_dict(harness) if isinstance(harness, dict) else HarnessConfig(),
        )


@dataclass
class ExecutionOutcome:
    execution_id: str
    problem_id: str
    group_id: str
    status: Status
    reward: float | None
    reward_source: RewardSource | None
    calls: int = 0
    branches: int = 0
    summaries: int = 0
    subagents: int = 0
    violations: int = 0
    duration_s: float = 0.0
    turn_budget: int | None = None
    snapshot_uri: str | None = None
    log_uri: str | None = None
    grade: dict[str, Any] | None = None
    error: str | None = None
    member_id: str | None = None
    """The id of the member's first attempt (execution_id_for with attempt 0): seeds its turn budget."""


class GatewayAdminError(RuntimeError):
    """The gateway refused an admin request; ``status`` is its HTTP status and ``code`` its error
    code (409 execution_finished: the id is finished there and cannot be registered again; 409
    execution_superseded: it belonged to an abandoned attempt)."""

    def __init__(self, path: str, status: int, text: str, code: str | None = None):
        super().__init__(f"gateway {path} answered {status}: {text[:500]}")
        self.path, self.status, self.code = path, status, code
        if code is None:  # the gateway's OpenAI-style body names it
            try:
                self.code = (json.loads(text).get("error") or {}).get("code")
            except (ValueError, AttributeError):
                self.code = None


class GatewayAdmin:
    """The gateway's admin API for executions: register, finish, and the gateway's stats. The same
    calls an external orchestrator makes (`gyre execution register|finish` use this class)."""

    def __init__(self, url: str, token: str, client: httpx.AsyncClient):
        self.url, self.client = url.rstrip("/"), client
        self.headers = {"Authorization": f"Bearer {token}"}

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self.client.request(
            method, f"{self.url}{path}", json=body, headers=self.headers, timeout=120
        )
        if response.status_code != 200:
            raise GatewayAdminError(path, response.status_code, response.text)
        return response.json()

    async def register(
        self,
        execution_id: str,
        *,
        problem_id: str | None = None,
        group_id: str | None = None,
        step: int | None = None,
        harness: str | None = None,
        campaign: str | None = None,
        attempt: str | None = None,
    ) -> dict[str, Any]:
        """{execution_id, step, campaign, base_url, agent_base_url, api_key, created}."""
        body = {
            "execution_id": execution_id,
            "problem_id": problem_id,
            "group_id": group_id,
            "step": step,
            "harness": harness,
            "campaign": campaign,
            "attempt": attempt,
        }
        return await self._request("POST", "/admin/executions", body)

    async def finish(
        self,
        execution_id: str,
        status: Status,
        *,
        reward: float | None,
        reward_source: RewardSource | None = None,
        snapshot_uri: str | None = None,
    ) -> dict[str, Any]:
        """{execution_id, status, calls, flush}: the gateway records the execution next to its calls."""
        body = {
            "status": status,
            "reward": reward,
            "reward_source": reward_source,
            "snapshot_uri": snapshot_uri,
        }
        return await self._request("POST", f"/admin/executions/{execution_id}/finish", body)

    async def execution(self, execution_id: str) -> dict[str, Any]:
        """A live execution: {execution_id, step, calls, agents}."""
        return await self._request("GET", f"/admin/executions/{execution_id}")

    async def stats(self) -> dict[str, Any]:
        """/admin/stats: engines, counters, and where the gateway records (store, step)."""
        return await self._request("GET", "/admin/stats")


SHELL_PREFIXES = {"cd", "export", "env", "exec", "time", "nice", "nohup", "&&", ";", "||"}


def harness_name(command: list[str] | None) -> str:
    """What executions.harness records: 'builtin', the program of an external command, or for a
    ``bash -c '<script>'`` command the script's first program (past ``VAR=value`` words and ``cd DIR &&``)."""
    if command is None:
        return "builtin"
    program = Path(command[0]).name
    if program in ("bash", "sh") and len(command) > 2 and command[1] == "-c":
        words = iter(command[2].replace(";", " ; ").split())
        for word in words:
            if word == "cd":
                next(words, None)  # its folder
            elif "=" not in word and word not in SHELL_PREFIXES and not word.startswith("-"):
                return Path(word).name
    return program


def group_id_for(step: int, problem: Problem, run_id: str | None = None) -> str:
    return f"s{step}-{problem.problem_id}" + (f"-{run_id}" if run_id else "")


def execution_id_for(
    step: int, problem: Problem, member: int, run_id: str | None = None, attempt: int = 0
) -> str:
    """s<step>-<problem>-g<member>[-<run_id>][-a<attempt>]: the same for a retry of the same run
    (retry-safe); a later attempt of a member whose dispatcher died gets -a<k> (StepLedger)."""
    base = f"s{step}-{problem.problem_id}-g{member}" + (f"-{run_id}" if run_id else "")
    return base if attempt == 0 else f"{base}-a{attempt}"


@dataclass(frozen=True)
class Ended:
    """How one execution the store holds ended."""

    execution_id: str
    group_id: str | None
    status: Status
    reward: float | None


@dataclass(frozen=True)
class StepLedger:
    """What the store holds of one step: the executions that ended, and every id that took a call
    (a dispatcher or gateway that died leaves calls without an execution row)."""

    step: int
    ended: dict[str, Ended]
    used: frozenset[str]

    def outcome(self, problem: Problem, member: int, run_id: str | None = None) -> Ended | None:
        """The attempt of this member that ended (with any status but abandoned), if one did."""
        for attempt in range(len(self.used) + 1):
            execution_id = execution_id_for(self.step, problem, member, run_id, attempt)
            row = self.ended.get(execution_id)
            if row is not None and row.status != "abandoned":
                return row
            if execution_id not in self.used:
                return None
        return None

    def next_attempt(self, problem: Problem, member: int, run_id: str | None = None) -> int:
        """The first attempt of this member whose id the store has never seen."""
        attempt = 0
        while execution_id_for(self.step, problem, member, run_id, attempt) in self.used:
            attempt += 1
        return attempt


def step_ledger(store: StoreConfig, step: int) -> StepLedger:
    """The step's ledger, read from the store's executions and calls of that step only."""
    target = Store(store)
    rows = target.read_columns(
        "executions", ["execution_id", "group_id", "status", "reward"], step
    ).to_pylist()
    ended = {
        r["execution_id"]: Ended(r["execution_id"], r["group_id"], r["status"], r["reward"]) for r in rows
    }
    called = target.read_columns("calls", ["execution_id"], step).column("execution_id").to_pylist()
    return StepLedger(step, ended, frozenset(ended) | frozenset(called))


async def dispatch(
    problems: list[Problem],
    gateway_url: str,
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
    between batches (a scheduler dispatches one execution at a time); None: one for this batch."""
    config = config or DispatchConfig()
    if config.workspace_root:
        root = config.workspace_root
    else:
        sweep_dead_dispatchers()
        root = tempfile.mkdtemp(prefix="gyre-workspaces-")
        _own(root)
    Path(root).mkdir(parents=True, exist_ok=True)
    semaphore = asyncio.Semaphore(config.concurrency)
    runner = _Runner(Store(store), config, root, ledger or step_ledger(store, config.step), zygote)
    refused: list[GatewayAdminError] = []
    try:
        async with httpx.AsyncClient() as client:
            admin = GatewayAdmin(gateway_url, admin_token, client)

            async def one(problem: Problem, member: int) -> ExecutionOutcome | None:
                async with semaphore:
                    if refused:
                        return None
                    try:
                        outcome = await runner.run(admin, problem, member)
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


OWNER_FILE = ".gyre-dispatcher"
"""In a dispatcher's temporary folders: its pid, so a later dispatcher can tell they were left."""
HARNESS_FILE = ".gyre-harnesses"
"""Next to the owner file of a dispatcher's harness folder: one line ``<pgid> <start time>`` per
harness still running, so a later dispatcher can kill the harnesses of one that was SIGKILLed."""


def _own(folder: str | Path) -> None:
    Path(folder, OWNER_FILE).write_text(str(os.getpid()))


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot): with the pid, it names one process for
    good, so a pid reused by another process is told apart. None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # after the command name, which may hold spaces


def _record_harness(folder: str | Path, pgid: int) -> None:
    """Adds a harness (the leader of its own process group) to ``folder``'s HARNESS_FILE."""
    started = _start_time(pgid)
    if started is not None:  # always, on Linux: a harness that already exited is a zombie until waited
        with open(Path(folder, HARNESS_FILE), "a") as records:
            records.write(f"{pgid} {started}\n")


def _forget_harness(folder: str | Path, pgid: int) -> None:
    """Drops an ended (and waited) harness from HARNESS_FILE: its pid may be reused from now on.
    Written aside then renamed, so a dispatcher killed meanwhile leaves the whole list."""
    path = Path(folder, HARNESS_FILE)
    with contextlib.suppress(OSError):
        kept = [line for line in path.read_text().splitlines() if line.split()[:1] != [str(pgid)]]
        Path(f"{path}.new").write_text("".join(f"{line}\n" for line in kept))
        os.replace(f"{path}.new", path)


def _kill_harnesses(folder: Path) -> int:
    """SIGKILLs the process groups a dead dispatcher recorded in ``folder``'s HARNESS_FILE; returns
    how many. A group is killed when its leader is the recorded process (same start time) or is gone:
    a pid is never reused while a group of that id has members, so they are the harness's own. A
    leader with another start time is a reused pid: left alone."""
    try:
        lines = (folder / HARNESS_FILE).read_text().splitlines()
    except OSError:
        return 0
    killed = 0
    for line in lines:
        try:
            pgid, started = (int(part) for part in line.split())
        except ValueError:
            continue
        if _start_time(pgid) not in (None, started):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            killed += 1
    return killed


def sweep_dead_dispatchers(parent: str | Path | None = None) -> int:
    """Kills the harnesses of, releases the quota mounts of, and removes the temporary workspace
    and harness folders of dispatchers whose process is gone (SIGKILLed: their cleanup never ran; a
    hanging harness would hold its CPU and sandbox for good; a tmpfs holds its files in memory);
    returns how many folders. Folders of live dispatchers, or with no owner, are kept untouched."""
    parent = Path(parent or tempfile.gettempdir())
    swept = killed = 0
    for folder in sorted([*parent.glob("gyre-workspaces-*"), *parent.glob("gyre-harness-*")]):
        try:
            pid = int((folder / OWNER_FILE).read_text())
            os.kill(pid, 0)
            continue  # alive (or reused by another process: kept, the safe side)
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue
        killed += _kill_harnesses(folder)
        release_mounts(folder)
        shutil.rmtree(folder, ignore_errors=True)
        swept += 1
    if swept:
        log.warning(
            "killed %d harnesses, released and removed %d folders of dispatchers that died", killed, swept
        )
    return swept


async def dispatch_missing(
    problems: list[Problem],
    gateway_url: str,
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


class _Runner:
    def __init__(
        self,
        store: Store,
        config: DispatchConfig,
        root: str,
        ledger: StepLedger,
        zygote: Zygote | None = None,
    ):
        self.store, self.config, self.root, self.ledger = store, config, Path(root), ledger
        self.token = secrets.token_hex(16)  # this dispatcher's attempts (RegisterExecution.attempt)
        self.snapshots = SnapshotStore(store)  # one blob index for the whole batch: a group shares files
        self.harness_name = config.harness_name or harness_name(config.harness_command)
        # harness inputs and outputs live apart from the workspaces, where no command can see them
        self.side_root = Path(tempfile.mkdtemp(prefix="gyre-harness-"))
        _own(self.side_root)
        self.zygote = zygote  # the built-in harness's warm launcher, started when first used
        self.own_zygote = zygote is None

    def _zygote(self) -> Zygote:
        if self.zygote is None:
            self.zygote = Zygote(builtin_harness_env())
        return self.zygote

    async def close(self) -> None:
        if self.zygote is not None and self.own_zygote:
            await self.zygote.close()

    async def run(self, admin: GatewayAdmin, problem: Problem, member: int) -> ExecutionOutcome:
        config = self.config
        group_id = group_id_for(config.step, problem, config.run_id)
        started = time.monotonic()
        execution_id, registration = await self._register(admin, problem, member, group_id)
        outcome = ExecutionOutcome(execution_id, problem.problem_id, group_id, "error", 0.0, "placeholder")
        outcome.member_id = execution_id_for(config.step, problem, member, config.run_id)
        try:
            await self._execute(problem, execution_id, registration, outcome)
        except Exception as exc:  # one execution's failure never stops the batch: it is recorded
            log.exception("execution %s failed in the dispatcher", execution_id)
            outcome.status, outcome.reward, outcome.reward_source = "error", 0.0, "placeholder"
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.duration_s = time.monotonic() - started
        finished = await admin.finish(
            execution_id,
            outcome.status,
            reward=outcome.reward,
            reward_source=outcome.reward_source,
            snapshot_uri=outcome.snapshot_uri,
        )
        outcome.calls = max(outcome.calls, int(finished.get("calls") or 0))
        return outcome

    async def _register(
        self, admin: GatewayAdmin, problem: Problem, member: int, group_id: str
    ) -> tuple[str, dict[str, Any]]:
        """Registers the member's first attempt the store has not seen; an attempt the gateway still
        holds for a dead dispatcher is abandoned there (409 execution_superseded) and the next taken.
        Earlier attempts that took calls and never ended are recorded as abandoned first."""
        config = self.config
        if (ended := self.ledger.outcome(problem, member, config.run_id)) is not None:
            message = f"execution {ended.execution_id} already finished ({ended.status} in the store); register a new id"
            raise GatewayAdminError("/admin/executions", 409, message, code="execution_finished")
        first = self.ledger.next_attempt(problem, member, config.run_id)
        for attempt in range(first):
            earlier = execution_id_for(config.step, problem, member, config.run_id, attempt)
            if earlier not in self.ledger.ended:
                await self._abandon(admin, earlier, problem, group_id)
        for attempt in range(first, first + MAX_ATTEMPTS):
            execution_id = execution_id_for(config.step, problem, member, config.run_id, attempt)
            try:
                registration = await self._register_as_mine(admin, execution_id, problem, group_id)
            except GatewayAdminError as exc:
                if exc.code != "execution_superseded":
                    raise
                log.warning(
                    "execution %s was left by a dead dispatcher: abandoned, next attempt", execution_id
                )
                continue
            return execution_id, registration
        raise RuntimeError(
            f"member {member} of {problem.problem_id} at step {config.step}: {MAX_ATTEMPTS} attempts in a "
            "row were superseded; another dispatcher is running the same step"
        )

    async def _register_as_mine(
        self, admin: GatewayAdmin, execution_id: str, problem: Problem, group_id: str
    ) -> dict[str, Any]:
        """Registers ``execution_id`` under this dispatcher's attempt token."""
        return await admin.register(
            execution_id,
            problem_id=problem.problem_id,
            group_id=group_id,
            step=self.config.step,
            harness=self.harness_name,
            campaign=self.config.campaign,
            attempt=self.token,
        )

    async def _abandon(self, admin: GatewayAdmin, execution_id: str, problem: Problem, group_id: str) -> None:
        """Gives a dead attempt its ending: abandoned by the gateway if it is live there (superseded),
        else (the gateway restarted since) registered again and finished as abandoned at once."""
        try:
            await self._register_as_mine(admin, execution_id, problem, group_id)
        except GatewayAdminError as exc:
            if exc.code in ("execution_superseded", "execution_finished"):
                return
            raise
        await admin.finish(execution_id, "abandoned", reward=None)

    async def _execute(self, problem, execution_id, registration, outcome: ExecutionOutcome) -> None:
        config = self.config
        name = secrets.token_hex(8)  # opaque: a path never names the problem or the execution
        side = self.side_root / name
        side.mkdir(parents=True)
        limits = replace(
            config.harness.limits, disk_bytes=config.workspace_disk_bytes, disk_files=config.workspace_files
        )
        sandbox = Sandbox.create(self.root, name, problem.files, limits)
        try:
            await self._run_harness(problem, execution_id, registration, sandbox, side, outcome)
        finally:
            if not config.keep_workspaces:
                sandbox.release()
                shutil.rmtree(sandbox.workspace, ignore_errors=True)
                shutil.rmtree(side, ignore_errors=True)

    async def _run_harness(self, problem, execution_id, registration, sandbox, side, outcome) -> None:
        config = self.config
        (side / "problem.json").write_text(json.dumps(problem.public().to_json()))
        (side / "instruction.md").write_text(problem.instruction)
        result_path = side / "result.json"
        argv, env = self._command(execution_id, registration, sandbox.workspace, side, outcome)
        log_path = side / "harness.log"
        if config.harness_command is None and config.harness_zygote:
            pid = await self._zygote().spawn(argv[3:], env, str(log_path))  # argv[3:]: after -m module

            def waited() -> Awaitable[int]:
                return self.zygote.wait(pid)
        else:
            with open(log_path, "wb") as log_file:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdout=log_file, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True
                )
            pid, waited = process.pid, process.wait
        _record_harness(self.side_root, pid)  # its own group: pgid == pid
        try:
            returncode = await asyncio.wait_for(waited(), config.timeout_s)
            timed_out = False
        except TimeoutError:
            _kill_group(pid)
            await waited()
            returncode, timed_out = None, True
        except ZygoteLost:
            _kill_group(pid)  # orphaned with its zygote: it must not go on calling the gateway
            raise
        finally:
            _forget_harness(self.side_root, pid)
        _read_progress(result_path, outcome)
        if timed_out:
            outcome.status = "timeout"
            await self._grade_snapshot(problem, execution_id, sandbox.workspace, outcome)
        elif returncode != 0:
            outcome.status, outcome.reward, outcome.reward_source = "error", 0.0, "placeholder"
            outcome.error = f"the harness exited with code {returncode}"
            outcome.log_uri = self._keep_log(execution_id, log_path)
        else:
            outcome.status = "completed"
            await self._grade(problem, sandbox.workspace, outcome, "final")
            if config.snapshot_completed:
                await self._snapshot_final(problem, execution_id, sandbox.workspace, outcome)
        if outcome.status == "eval_failed":
            outcome.log_uri = self._keep_log(execution_id, log_path)

    def _command(self, execution_id, registration, workspace: Path, side: Path, outcome):
        config = self.config
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(side),
            "LANG": "C.UTF-8",
            "OPENAI_BASE_URL": registration["base_url"],
            "OPENAI_API_KEY": registration["api_key"],
        }
        if config.harness_command is None:
            env.update(builtin_harness_env())  # gyre's path for ours only: an external harness keeps
            # its own environment (gyre's path would shadow a harness in another venv)
            harness = config.harness
            turns = config.durations.turns(outcome.member_id or execution_id)
            outcome.turn_budget = turns
            seed = int(hashlib.md5(execution_id.encode()).hexdigest()[:8], 16)
            fields = {**asdict(harness), "max_turns": turns, "seed": seed}
            argv = [
                sys.executable, "-m", "environments.harness",
                "--problem", str(side / "problem.json"),
                "--workspace", str(workspace),
                "--base-url", registration["base_url"],
                "--api-key", registration["api_key"],
                "--result", str(side / "result.json"),
                "--config", json.dumps(fields),
            ]  # fmt: skip
            return argv, env
        values = {
            "base_url": registration["base_url"],
            "api_key": registration["api_key"],
            "workspace": str(workspace),
            "instruction_file": str(side / "instruction.md"),
        }
        return [part.format(**values) for part in config.harness_command], env

    async def _store_snapshot(self, problem, execution_id, workspace: Path, source: str) -> str:
        """The workspace as snapshot rows (with the problem's starting files as its template)."""
        return await asyncio.to_thread(
            store_workspace,
            self.snapshots,
            self.config.step,
            execution_id,
            workspace,
            problem_id=problem.problem_id,
            source=source,
            template_files=problem.files,
        )

    async def _grade_snapshot(self, problem, execution_id, workspace: Path, outcome) -> None:
        if not workspace.is_dir():  # nothing to grade at all
            outcome.reward, outcome.reward_source = 0.0, "placeholder"
            return
        outcome.snapshot_uri = await self._store_snapshot(problem, execution_id, workspace, "timeout")
        fresh = Path(tempfile.mkdtemp(prefix="gyre-regrade-"))
        try:  # graded from what was stored, never from the workspace itself
            restored = await asyncio.to_thread(
                sandbox_from_stored, self.snapshots, outcome.snapshot_uri, fresh, secrets.token_hex(8)
            )
        except (UnsafeArchive, StoreError, OSError) as exc:
            shutil.rmtree(fresh, ignore_errors=True)
            outcome.status, outcome.reward, outcome.reward_source = "eval_failed", None, None
            outcome.error = f"snapshot unusable: {exc}"
            return
        try:
            await self._grade(problem, restored.workspace, outcome, "workspace_snapshot")
        finally:
            shutil.rmtree(fresh, ignore_errors=True)

    async def _snapshot_final(self, problem, execution_id, workspace: Path, outcome) -> None:
        """Stores a completed execution's final workspace; a failure is logged, never fatal: the
        execution was graded from the workspace itself."""
        try:
            outcome.snapshot_uri = await self._store_snapshot(problem, execution_id, workspace, "final")
        except (ValueError, OSError):
            log.exception("execution %s: its final workspace could not be snapshotted", execution_id)

    async def _grade(self, problem: Problem, workspace: Path, outcome, source: str) -> None:
        errors = []
        for _ in range(self.config.grader_retries + 1):
            try:
                result: GradeResult = await asyncio.to_thread(
                    grade_workspace, problem, workspace, timeout_s=self.config.grade_timeout_s
                )
            except GraderError as exc:
                errors.append(str(exc))
                continue
            outcome.reward, outcome.reward_source = result.reward, source
            outcome.grade = {"passed": result.passed, "total": result.total}
            return
        outcome.status, outcome.reward, outcome.reward_source = "eval_failed", None, None
        outcome.error = f"the grader failed {len(errors)} times; last: {errors[-1]}"

    def _keep_log(self, execution_id: str, log_path: Path) -> str | None:
        if not log_path.exists():
            return None
        key = self.store.path("logs", f"{execution_id}.log")
        self.store.write_bytes(key, log_path.read_bytes())
        return self.store.url(key)


def builtin_harness_env() -> dict[str, str]:
    """What the built-in harness's processes (and their zygote) need beyond an execution's own
    variables: a PATH, a locale and gyre's module path."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _read_progress(path: Path, outcome: ExecutionOutcome) -> None:
    try:
        stats = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return  # an external harness, or one killed before its first call
    outcome.calls = int(stats.get("calls", 0))
    outcome.branches = int(stats.get("branches", 0))
    outcome.summaries = int(stats.get("summaries", 0))
    outcome.subagents = int(stats.get("subagents", 0))
    outcome.violations = len(stats.get("violations", []))
