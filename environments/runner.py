"""One execution, from its registration at the gateway to its finish: ExecutionRunner.

    runner = ExecutionRunner(store, config, workspace_root, ledger)
    outcome = await runner.run(admin, problem, member)     # an ExecutionOutcome, whatever happened

``run`` registers the member's next attempt (ledger.py picks its id; an attempt the gateway holds for
a dead dispatcher is abandoned there and the next taken), makes its sandboxed workspace, starts the
harness (the built-in one through a zygote; an external command, the problem's own or the config's,
inside the execution's sandbox: environments/sandbox_harness.py), waits for it until the deadline,
then grades the final workspace, or the workspace snapshot of a timed-out execution, with retries
(within the problem's grade timeout, else the config's), and finishes the execution at the gateway.
A kept workspace (keep_workspaces) leaves its quota mount as a plain folder. One execution's failure
is recorded in its outcome, never raised: environments/dispatch.py runs many runners' executions at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from environments.dispatch_config import DispatchConfig
from environments.execution_grade import Graded, grade_final, grade_snapshot
from environments.gateway_admin import EXECUTIONS, GatewayAdmin, GatewayAdminError
from environments.gateways import GatewayPool
from environments.ledger import StepLedger, execution_id_for, group_id_for
from environments.problems import Problem
from environments.relay import LoopbackRelay, Upstreams, gateway_address
from environments.sandbox import Sandbox
from environments.sandbox_harness import ConfinedHarness, harness_files, relayed_url
from environments.snapshot_rows import store_workspace
from environments.sweep import forget_harness, own, record_harness
from environments.workspace_tree import remove_tree
from environments.zygote import Zygote, ZygoteLost
from trajectory_store.schema import RewardSource, Status
from trajectory_store.snapshots import SnapshotStore
from trajectory_store.storage import Store

log = logging.getLogger(__name__)
HARNESS_TASKS = 512
"""Tasks (processes and threads) an external harness and everything it started may have at once: a
harness runs thread pools of its own (64 concurrent calls, a Node runtime), so it gets more than one
tool command's ``limits.processes``."""
HARNESS_MEMORY_BYTES = 8 << 30
"""Address space per process of an external harness, at least (each thread's stack counts)."""
MAX_ATTEMPTS = 8
"""Attempts of one member superseded in a row before the dispatcher gives up (two dispatchers on one
step would supersede each other's attempts)."""


class MemberEnded(Exception):
    """A member's earlier attempt turned out to have ended at the gateway (its row not yet in the
    store the ledger was read from): the member has its ending, and no attempt of it runs again."""

    def __init__(self, execution_id: str):
        super().__init__(f"execution {execution_id} already ended at the gateway: its member is done")
        self.execution_id = execution_id


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
    """The id of the member's first attempt (execution_id_for with attempt 0; without the run id when
    ``same_work_across_runs``): keys its turn budget (and, with that option, its sampling seed)."""


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


class ExecutionRunner:
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
        # harness inputs and outputs live apart from the workspaces, where no command can see them
        self.side_root = Path(tempfile.mkdtemp(prefix="gyre-harness-"))
        own(self.side_root)
        self.zygote = zygote  # the built-in harness's warm launcher, started when first used
        self.own_zygote = zygote is None
        self.sandboxes: set[Sandbox] = set()  # live ones, with their quota mounts: released by close

    def _zygote(self) -> Zygote:
        if self.zygote is None:
            self.zygote = Zygote(builtin_harness_env())
        return self.zygote

    async def close(self) -> None:
        """Stops the zygote this runner started and releases every quota mount it still holds."""
        for sandbox in list(self.sandboxes):
            sandbox.release()
            self.sandboxes.discard(sandbox)
        if self.zygote is not None and self.own_zygote:
            await self.zygote.close()

    def command_of(self, problem: Problem) -> list[str] | None:
        """The external harness command of ``problem``: its suite's own, else the config's (None: builtin)."""
        return problem.harness if problem.harness is not None else self.config.harness_command

    def harness_name_of(self, problem: Problem) -> str:
        """What executions.harness records for ``problem``: config.harness_name names the config's harness."""
        if problem.harness is not None:
            return harness_name(problem.harness)
        return self.config.harness_name or harness_name(self.config.harness_command)

    async def run(self, admin: GatewayAdmin | GatewayPool, problem: Problem, member: int) -> ExecutionOutcome:
        config = self.config
        group_id = group_id_for(config.step, problem, config.run_id)
        started = time.monotonic()
        execution_id, registration = await self._register(admin, problem, member, group_id)
        outcome = ExecutionOutcome(execution_id, problem.problem_id, group_id, "error", 0.0, "placeholder")
        run_id = None if config.same_work_across_runs else config.run_id
        outcome.member_id = execution_id_for(config.step, problem, member, run_id)
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
            raise GatewayAdminError(EXECUTIONS, 409, message, code="execution_finished")
        first = self.ledger.next_attempt(problem, member, config.run_id)
        for attempt in range(first):
            earlier = execution_id_for(config.step, problem, member, config.run_id, attempt)
            if earlier not in self.ledger.ended and await self._abandon(admin, earlier, problem, group_id):
                raise MemberEnded(earlier)
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
            harness=self.harness_name_of(problem),
            campaign=self.config.campaign,
            attempt=self.token,
        )

    async def _abandon(self, admin: GatewayAdmin, execution_id: str, problem: Problem, group_id: str) -> bool:
        """Gives a dead attempt its ending: abandoned by the gateway if it is live there (superseded),
        else (the gateway restarted since) registered again and finished as abandoned at once. True
        when the gateway had already finished it: the dead dispatcher ended it just before it died and
        its row is on its way to the store (the ledger was read before it landed)."""
        try:
            await self._register_as_mine(admin, execution_id, problem, group_id)
        except GatewayAdminError as exc:
            if exc.code == "execution_superseded":
                return False
            if exc.code == "execution_finished":
                return True
            raise
        await admin.finish(execution_id, "abandoned", reward=None)
        return False

    async def _execute(self, problem, execution_id, registration, outcome: ExecutionOutcome) -> None:
        config = self.config
        name = secrets.token_hex(8)  # opaque: a path never names the problem or the execution
        side = self.side_root / name
        side.mkdir(parents=True)
        limits = replace(
            config.harness.limits, disk_bytes=config.workspace_disk_bytes, disk_files=config.workspace_files
        )
        sandbox = Sandbox.create(self.root, name, problem.files, limits)
        self.sandboxes.add(sandbox)
        try:
            await self._run_harness(problem, execution_id, registration, sandbox, side, outcome)
        finally:
            if not config.keep_workspaces:
                sandbox.release()
                await asyncio.to_thread(_remove_quietly, sandbox.workspace, side)  # any depth: off the loop
                self.sandboxes.discard(sandbox)
            else:  # its files stay, in a plain folder: no quota mount outlives the execution
                try:
                    await asyncio.to_thread(sandbox.release_keeping_files)  # a copy: off the loop
                    self.sandboxes.discard(sandbox)
                except Exception:  # its mount is released by close(), files and all
                    log.exception("execution %s: its workspace could not be kept", execution_id)

    async def _run_harness(self, problem, execution_id, registration, sandbox, side, outcome) -> None:
        config = self.config
        (side / "problem.json").write_text(json.dumps(problem.public().to_json()))
        (side / "instruction.md").write_text(problem.instruction)
        command = self.command_of(problem)
        confined = command is not None and config.harness_sandbox
        fallbacks = registration.get("base_urls", [])[1:]  # the standby gateway (environments/gateways.py)
        relay = None
        if confined:
            base_url = relayed_url(sandbox, registration["base_url"])
        elif fallbacks:  # the harness dials one address: a relay on loopback moves on for it
            urls = [registration["base_url"], *fallbacks]
            relay = await LoopbackRelay.start(Upstreams([gateway_address(url) for url in urls]))
            base_url = relay.url(registration["base_url"])
        else:
            base_url = registration["base_url"]
        try:
            await self._run_harness_at(
                problem, execution_id, registration, sandbox, side, outcome, command, base_url, fallbacks
            )
        finally:
            if relay is not None:
                await relay.close()

    async def _run_harness_at(
        self, problem, execution_id, registration, sandbox, side, outcome, command, base_url, fallbacks
    ) -> None:
        config = self.config
        result_path = side / "result.json"
        confined = command is not None and config.harness_sandbox
        argv, env = self._command(
            command, execution_id, base_url, registration, sandbox.workspace, side, outcome
        )
        log_path = side / "harness.log"
        harness = None
        if confined:
            harness = await self._confine(
                argv, env, sandbox, side, registration["base_url"], log_path, fallbacks
            )
            pid, waited = harness.pid, harness.wait
        elif command is None and config.harness_zygote:
            pid = await self._zygote().spawn(argv[3:], env, str(log_path))  # argv[3:]: after -m module

            def waited() -> Awaitable[int]:
                return self.zygote.wait(pid)
        else:
            with open(log_path, "wb") as log_file:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdout=log_file, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True
                )
            pid, waited = process.pid, process.wait
        record_harness(self.side_root, pid)  # its own group: pgid == pid
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
            if harness is not None:
                await harness.close()
            forget_harness(self.side_root, pid)
        _read_progress(result_path, outcome)
        if timed_out:
            outcome.status = "timeout"
            await self._grade_snapshot(problem, execution_id, sandbox.workspace, outcome)
        elif returncode != 0:
            outcome.status, outcome.reward, outcome.reward_source = "error", 0.0, "placeholder"
            outcome.error = f"the harness exited with code {returncode}"
            if harness is not None and (setup := harness.setup_error()):
                outcome.error = f"the sandbox could not start the harness: {setup}"
            outcome.log_uri = self._keep_log(execution_id, log_path)
        else:
            outcome.status = "completed"
            await self._grade(problem, sandbox.workspace, outcome)
            if config.snapshot_completed:
                await self._snapshot_final(problem, execution_id, sandbox.workspace, outcome)
        if outcome.status == "eval_failed":
            outcome.log_uri = self._keep_log(execution_id, log_path)

    async def _confine(
        self, argv, env, sandbox: Sandbox, side: Path, gateway_url: str, log_path: Path, fallbacks=()
    ):
        """Starts an external harness inside the execution's sandbox: its own folder (``side``) and
        installation visible read-only, HOME on its private /tmp, the sandbox limits with the
        execution's deadline as CPU limit, the gateway reached through a relay."""
        config = self.config
        env["HOME"] = "/tmp"  # its private tmpfs: gone with the harness
        visible = [*harness_files(argv, env, config.harness_paths), str(side)]
        tool = config.harness.limits
        limits = replace(
            tool,
            cpu_s=max(tool.cpu_s, math.ceil(config.timeout_s)),
            processes=max(tool.processes, HARNESS_TASKS),
            memory_bytes=max(tool.memory_bytes, HARNESS_MEMORY_BYTES),
        )
        return await ConfinedHarness.start(
            sandbox, argv, env, log_path, gateway_url, limits, visible, fallback_urls=fallbacks
        )

    def _command(
        self, command, execution_id, base_url: str, registration, workspace: Path, side: Path, outcome
    ):
        """argv and environment of the harness: the built-in one (``command`` None) or ``command``
        with its placeholders filled; ``base_url`` is the gateway's, or its relay for a confined one."""
        config = self.config
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(side),
            "LANG": "C.UTF-8",
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": registration["api_key"],
        }
        if command is None:
            env.update(builtin_harness_env())  # gyre's path for ours only: an external harness keeps
            # its own environment (gyre's path would shadow a harness in another venv)
            harness = config.harness
            turns = config.durations.turns(outcome.member_id or execution_id)
            outcome.turn_budget = turns
            seed_key = (outcome.member_id if config.same_work_across_runs else None) or execution_id
            seed = int(hashlib.md5(seed_key.encode()).hexdigest()[:8], 16)
            fields = {**asdict(harness), "max_turns": turns, "seed": seed}
            argv = [
                sys.executable, "-m", "environments.harness",
                "--problem", str(side / "problem.json"),
                "--workspace", str(workspace),
                "--base-url", base_url,
                "--api-key", registration["api_key"],
                "--result", str(side / "result.json"),
                "--config", json.dumps(fields),
            ]  # fmt: skip
            return argv, env
        values = {
            "base_url": base_url,
            "api_key": registration["api_key"],
            "workspace": str(workspace),
            "instruction_file": str(side / "instruction.md"),
        }
        return [part.format(**values) for part in command], env

    async def _grade_snapshot(self, problem, execution_id, workspace: Path, outcome) -> None:
        graded = await asyncio.to_thread(
            grade_snapshot,
            problem,
            workspace,
            self.snapshots,
            self.config.step,
            execution_id,
            timeout_s=self._grade_timeout(problem),
            retries=self.config.grader_retries,
        )
        self._record(graded, outcome)

    async def _snapshot_final(self, problem, execution_id, workspace: Path, outcome) -> None:
        """Stores a completed execution's final workspace; a failure is logged, never fatal: the
        execution was graded from the workspace itself."""
        try:
            outcome.snapshot_uri = await asyncio.to_thread(
                store_workspace,
                self.snapshots,
                self.config.step,
                execution_id,
                workspace,
                problem_id=problem.problem_id,
                source="final",
                template_files=problem.files,
            )
        except Exception:  # the walk never raises for the workspace: a failure of ours, not the agent's
            log.exception("execution %s: its final workspace could not be snapshotted", execution_id)

    async def _grade(self, problem: Problem, workspace: Path, outcome) -> None:
        graded = await asyncio.to_thread(
            grade_final,
            problem,
            workspace,
            timeout_s=self._grade_timeout(problem),
            retries=self.config.grader_retries,
        )
        self._record(graded, outcome)

    def _grade_timeout(self, problem: Problem) -> float:
        return problem.grade_timeout_s if problem.grade_timeout_s is not None else self.config.grade_timeout_s

    @staticmethod
    def _record(graded: Graded, outcome) -> None:
        outcome.reward, outcome.reward_source, outcome.grade = graded.reward, graded.source, graded.grade
        outcome.snapshot_uri = graded.snapshot_uri or outcome.snapshot_uri
        outcome.error = graded.error or outcome.error
        if graded.eval_failed:
            outcome.status = "eval_failed"

    def _keep_log(self, execution_id: str, log_path: Path) -> str | None:
        if not log_path.exists():
            return None
        key = self.store.path("logs", f"{execution_id}.log")
        self.store.write_bytes(key, log_path.read_bytes())
        return self.store.url(key)


def _remove_quietly(*paths: Path) -> None:
    """Removes an execution's folders; a failure is logged (the outcome stands)."""
    for path in paths:
        try:
            remove_tree(path)
        except OSError:
            log.exception("could not remove %s", path)


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
