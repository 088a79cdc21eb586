"""How a batch of executions runs: DispatchConfig (and its DurationProfile), the config that
environments/dispatch.py and its runners (environments/runner.py) read; campaigns carry it as
[dispatch] in their TOML."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

from environments.harness_config import HarnessConfig


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
    """The step the executions belong to (ids and the store's partition); a campaign sets it per step."""
    group_size: int = 1
    """Executions per problem (one GRPO group)."""
    concurrency: int = 4
    """Executions running at once."""
    timeout_s: float = 120.0
    """Deadline of one execution (harness wall clock); then snapshot + grade."""
    grader_retries: int = 2
    """Extra attempts of a failing grader before the execution is eval_failed."""
    grade_timeout_s: float = 60.0
    """Deadline of one grading of a workspace (the hidden checks), per attempt."""
    durations: DurationProfile = field(default_factory=DurationProfile)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    harness_command: list[str] | None = None
    """An external harness: argv template with {base_url} {api_key} {workspace} {instruction_file};
    None runs the built-in harness."""
    harness_sandbox: bool = True
    """Start an external harness inside its execution's sandbox (environments/sandbox_harness.py): it
    and every command it runs see their workspace read-write, the system read-only and their own
    installation, under the limits of ``harness.limits`` (CPU: the deadline), and reach the gateway
    alone, through a relay on their own loopback. False: the harness runs on the host as the dispatcher's
    user, able to read the checkout (the problem generators and graders), the store and other
    workspaces, and to reach every loopback service: only for a harness you trust not to look."""
    harness_paths: list[str] = field(default_factory=list)
    """Folders a sandboxed external harness sees read-only besides its program, its script, the
    virtualenv they live in and the Python gyre runs on (e.g. a node installation, a config folder)."""
    harness_name: str | None = None
    """Recorded in executions.harness (default: 'builtin' or the command's program name)."""
    workspace_root: str | None = None
    """Where workspaces go (default: a fresh temporary folder, removed at the end)."""
    keep_workspaces: bool = False
    """Leave each execution's workspace on disk after it is graded (to look at what an agent did)."""
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
    same_work_across_runs: bool = False
    """Key each execution's turn budget (``durations``) and sampling seed by its step, problem and
    member alone, not by ``run_id``: runs that differ only in run_id (policies compared on one
    gateway, bench/schedule_real.py) get the same work, the same long executions and the same
    samples from the same weights. False: the execution id, run_id included, keys both."""
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
