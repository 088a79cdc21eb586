"""The campaign rows of `gyre bench faults`: a process of a running campaign SIGKILLed, audited in
the store.

Each row runs `gyre run` (a process of its own, against the services `gyre up` starts for a data root
of the row's kind) on a small campaign, kills one process at a point of a step, and, when the run
dies with it, runs the same `gyre run --name` once more (what a user does, or the UI's Retry). Then:

- every step is committed once, version n+1 after step n;
- every group member of every step ended once (bench/faults_step.py audit: lost, duplicated, unended);
- no trajectory is trained twice: the (execution_id, trajectory_id) leaves of every step's packed
  batches are counted, and a key in two batches is a sample trained twice;
- the row's own check: what should have recovered by itself did (``reruns`` 0), and the revived
  service is back in use.

Rows (the process; when it dies; what recovers it; recovery_s is from the kill until the step it
interrupted is committed):

- `campaign process SIGKILL mid-step`: the `gyre run` process, mid-rollout. The services outlive it;
  `gyre run --name` again resumes at the step (the dead run's live executions become abandoned
  attempts, their members run again under new ids). One rerun expected.
- `trainer SIGKILL mid-train`: the step's trainer process (engines.train.run). The train task's retry
  restores the previous checkpoint and makes the same update. No rerun.
- `Prefect server SIGKILL mid-step`: the server of `gyre up`. The campaign's supervisor (`gyre run`
  watches the services) starts it again on its port and database; the client retries meanwhile.
- `rollout engine SIGKILL, restarted`: engine-1 of two, mid-rollout. The gateway reroutes its
  sessions; the supervisor starts it again serving its sibling's version; the next step's serve task
  gives it back to the gateway (its id is in that step's calls).
- `gateway SIGKILL, restarted`: the gateway, mid-rollout. The supervisor starts it again on its
  address (its spool replays the unflushed calls); the roll-out task's retry runs what is missing.
- `scheduler service SIGKILL mid-step` and `trainer core SIGKILL (scheduler)`: a campaign under
  ``[scheduler] policy = "elastic"``; the scheduler process, or its long-lived trainer core
  (engines.train.run --serve). The campaign task notices and starts the scheduler again from the store
  (metrics scheduler_restarts).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from stack.up import revivals
from trajectory_store.storage import Store, StoreConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """
policy = "{policy}"
steps = {steps}
[store]
data_root = "{data_root}"
[problems]
suites = ["terminal"]
per_step = 2
zero_signal = "keep"
[evaluation]
per_suite = 1
[dispatch]
group_size = 2
concurrency = 4
timeout_s = 60
[dispatch.durations]
short_turns = {turns}
long_fraction = {long_fraction}
long_factor = [3.0, 5.0]
[dispatch.harness]
max_tokens = 24
max_retries = 0
max_subagents = 0
[serving]
engines = {engines}
trainer_threads = 1
{scheduler}
"""
SCHEDULER = """
[scheduler]
policy = "elastic"
heartbeat_timeout_s = 60
[scheduler.params]
depth = 1
min_dwell_s = 1.0
gain_factor = 0.0
"""
RUN_TIMEOUT_S = 900


def write_config(root: Path, kind: str, policy: str, steps: int = 2) -> Path:
    """A small campaign on a data root per kind ("colocate": two engines; "scheduler": three, elastic)."""
    scheduled = kind == "scheduler"
    path = root / f"{kind}.toml"
    path.write_text(
        CONFIG.format(
            policy=policy,
            steps=steps,
            data_root=root / kind,
            turns=2,
            long_fraction=0.5 if scheduled else 0.0,
            engines=3 if scheduled else 2,
            scheduler=SCHEDULER if scheduled else "",
        )
    )
    return path


def gyre_run(config: Path, name: str, log: Path) -> subprocess.Popen:
    """`gyre run` in a session of its own (its harnesses and trainer die with it at cleanup); the
    services it starts are `gyre up`'s, with free ports."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own `gyre up` server
    command = [sys.executable, "-m", "cli.main", "run", "--config", str(config), "--name", name]
    command += ["--prefect-port", "0", "--gateway-port", "0", "--engine-port", "0"]
    out = open(log, "ab")  # noqa: SIM115  (the child holds it; closed at exit)
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def finish(process: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # what it left in its session (an orphan harness)


def pids_running(marker: bytes, *also: bytes, under: int | None = None) -> list[int]:
    """Processes whose command line holds ``marker`` and every one of ``also``; with ``under``, only
    descendants of that process (not another campaign's, or a developer's, on the same machine)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes()
            mine = under is None or under in _ancestors(int(entry.name))
            if marker in argv and all(a in argv for a in also) and mine:
                pids.append(int(entry.name))
    return pids


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
        chain.append(pid)
    return chain


def service_pid(data_root: str, name: str) -> int:
    from stack.up import read_record

    record = read_record(data_root)
    assert record is not None, f"no gyre up record for {data_root}"
    return next(s.pid for s in record.services if s.name == name)


def executions_of(store: StoreConfig, step: int) -> int:
    table = Store(store).read_table("executions")
    return sum(1 for s in table.column("step").to_pylist() if s == step)


def trained_twice(store: StoreConfig) -> int:
    """(execution_id, trajectory_id) keys in more than one packed batch of the campaign."""
    target = Store(store)
    keys: Counter = Counter()
    for path in target.fs.glob(target.path("batches/**/*.parquet")):
        for leaves in pq.read_table(target.fs.open(path, "rb"), columns=["leaves"]).column(0).to_pylist():
            keys.update({(leaf["execution_id"], leaf["trajectory_id"]) for leaf in leaves})
    return sum(1 for n in keys.values() if n > 1)


def scheduler_restarts(store: StoreConfig) -> float | None:
    from trajectory_store.db import connect

    con = connect(Store(store))
    try:
        return con.execute("SELECT max(value) FROM metrics WHERE name = 'scheduler_restarts'").fetchone()[0]
    except Exception:  # no metrics dataset: a campaign without the scheduler
        return None
    finally:
        con.close()


def campaign_audit(config_path: Path, name: str) -> tuple[dict[str, int], dict[str, Any]]:
    """Lost, duplicated, unended and abandoned work over every step, and the committed steps."""
    from bench.faults_step import audit
    from environments.problems import Problem
    from flows.config import CampaignConfig
    from tasks.commit import committed_steps
    from tasks.problems import step_problems

    config = CampaignConfig.from_toml(str(config_path)).merged({"name": name})
    store = config.store.model_copy(update={"campaign": name})
    totals = Counter()
    for step in range(config.steps):
        problems = [Problem.from_json(p) for p in step_problems(config.problems, step)]
        totals.update(audit(store, step, (problems, config.dispatch.group_size)))
    records = committed_steps(store)
    totals["duplicated"] += trained_twice(store)
    detail = {
        "steps": [r.step for r in records],
        "versions": [r.version for r in records],
        "committed_at": {r.step: r.committed_at for r in records},
        "trained_twice": trained_twice(store),
        # what the step table (UI artifact) and the metrics show of the fault
        "train_attempts": [r.metrics.get("train_attempts") for r in records],
        "services_revived": [r.metrics.get("services_revived") for r in records],
        "executions_abandoned": [r.metrics.get("executions_abandoned") for r in records],
        "scheduler_restarts": scheduler_restarts(store),
    }
    if len(records) < config.steps:  # a step never committed: its work is lost
        totals["lost"] += config.steps - len(records)
    return dict(totals), detail


Kill = tuple[Callable[[StoreConfig], bool], Callable[[subprocess.Popen], int]]


def campaign_fault(
    root: Path,
    kind: str,
    name: str,
    kills: list[Kill],
    policy: str,
    expect_reruns: int = 0,
    steps: int = 2,
    shows: Callable[[dict[str, Any]], bool] = lambda detail: True,
) -> tuple[dict[str, int], bool, float | None, dict[str, Any]]:
    """One run of a row: `gyre run`; for each (when, victim) of ``kills`` in turn, SIGKILL ``victim(run)``
    once ``when(store)`` holds; then reruns until the campaign completes (at most two). ``shows``: the
    fault is visible in the detail (metrics, revivals). Returns the audit, whether it held, the
    recovery seconds (from the first kill) and the detail."""
    config_path = write_config(root, kind, policy, steps)
    data_root = str(root / kind)
    store = StoreConfig(data_root=data_root, campaign=name)
    log = root / f"{name}.log"
    run = gyre_run(config_path, name, log)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    killed: list[float] = []
    try:
        while run.poll() is None and time.monotonic() < deadline and len(killed) < len(kills):
            when, victim = kills[len(killed)]
            with contextlib.suppress(Exception):  # a part being written is read next time
                if when(store):
                    os.kill(victim(run), signal.SIGKILL)
                    killed.append(time.time())
            time.sleep(0.1)  # an execution of two short turns is live for about a second
        codes = [finish(run)]
    finally:
        finish(run, 0)
    killed_at = killed[0] if killed else None
    reruns = 0
    while codes[-1] != 0 and reruns < 2:
        reruns += 1
        codes.append(finish(gyre_run(config_path, name, log)))
    counts, detail = campaign_audit(config_path, name)
    detail["revived"] = [r["name"] for r in revivals(data_root) if killed and r["wall"] >= killed[0]]
    interrupted = min(
        (step for step, at in detail["committed_at"].items() if killed_at and at >= killed_at), default=None
    )
    recovery = detail["committed_at"][interrupted] - killed_at if interrupted is not None else None
    checks = {
        "every kill made": len(killed) == len(kills),
        "the campaign completed": codes[-1] == 0,
        f"{expect_reruns} reruns": reruns == expect_reruns,
        "a version a step": detail["versions"] == [s + 1 for s in detail["steps"]],
        "the fault shows": shows(detail),
    }
    ok = all(checks.values())
    unmet = [check for check, held in checks.items() if not held]
    detail |= {"unmet": unmet, "kills": len(killed), "exit_codes": codes, "reruns": reruns, "log": str(log)}
    detail.pop("committed_at")
    return counts, ok, recovery, detail


# -- when to kill, and whom -------------------------------------------------------------------------


def mid_rollout(
    step: int = 0, attempts: tuple[int, ...] = (0,), calls: range = range(1, 1 << 30)
) -> Callable[[StoreConfig], bool]:
    """An execution of the step (one of ``attempts`` of a member) is live at the gateway with a number
    of ``calls`` made (asked of the gateway: the store sees an execution only once it ended, and a
    step's executions end close together). ``range(1, turns)``: it still has a call to make, so a
    gateway killed then cuts it short."""
    import httpx

    from environments.gateway_admin import execution_path
    from environments.ledger import execution_id_for
    from environments.problems import Problem
    from flows.config import CampaignConfig
    from stack.up import read_record
    from tasks.problems import step_problems

    ids: list[str] = []

    def when(store: StoreConfig) -> bool:
        record = read_record(store.data_root)
        if record is None:
            return False
        if not ids:
            config = CampaignConfig.from_toml(str(Path(store.data_root).with_suffix(".toml")))
            problems = [Problem.from_json(p) for p in step_problems(config.problems, step)]
            ids.extend(
                execution_id_for(step, problem, member, None, attempt)
                for problem in problems
                for member in range(config.dispatch.group_size)
                for attempt in attempts
            )
        headers = {"Authorization": f"Bearer {record.admin_token}"}
        for execution_id in ids:
            response = httpx.get(
                record.gateway_url + execution_path(execution_id), headers=headers, timeout=5
            )
            if response.status_code == 200 and response.json()["calls"] in calls:
                return True
        return False

    return when


def mid_train(step: int = 0) -> Callable[[StoreConfig], bool]:
    """The step's trainer process runs, a few seconds in (its model is loaded)."""
    seen: dict[int, float] = {}

    def when(store: StoreConfig) -> bool:
        pids = [p for p in pids_running(b"engines.train.run") if p not in seen]
        for pid in pids:
            seen.setdefault(pid, time.monotonic())
        return executions_of(store, step) >= 4 and any(time.monotonic() - t > 3 for t in seen.values())

    return when


def rows(root: Path, policy: str, quick: bool) -> list[tuple[str, Callable[[], tuple]]]:
    """The campaign rows as (name, a function that runs one and returns its result)."""
    colocate = str(root / "colocate")
    count = iter(range(1000))

    def run(kind: str, when, victim, reruns: int = 0, shows=lambda detail: True):
        return campaign_fault(root, kind, f"c{next(count)}", [(when, victim)], policy, reruns, shows=shows)

    def revived(name: str):
        return lambda detail: name in detail["revived"]

    def retried(detail) -> bool:
        return max(a or 0 for a in detail["train_attempts"]) >= 2

    def restarted(detail) -> bool:
        return (detail["scheduler_restarts"] or 0) >= 1

    def trainer(run) -> int:
        return pids_running(b"engines.train.run", under=run.pid)[0]

    def core(_run) -> int:
        return pids_running(b"engines.train.run", b"--serve")[0]

    def scheduler(_run) -> int:
        return pids_running(b"tasks.schedule")[0]

    return [
        ("campaign process SIGKILL mid-step", lambda: run("colocate", mid_rollout(), lambda r: r.pid, 1)),
        ("trainer SIGKILL mid-train", lambda: run("colocate", mid_train(), trainer, shows=retried)),
        (
            "Prefect server SIGKILL mid-step",
            lambda: run(
                "colocate",
                mid_rollout(),
                lambda r: service_pid(colocate, "prefect"),
                shows=revived("prefect"),
            ),
        ),
        (
            "rollout engine SIGKILL, restarted",
            lambda: run(
                "colocate",
                mid_rollout(),
                lambda r: service_pid(colocate, "engine-1"),
                shows=revived("engine-1"),
            ),
        ),
        (
            "gateway SIGKILL, restarted",
            lambda: run(
                "colocate",
                mid_rollout(),
                lambda r: service_pid(colocate, "gateway"),
                shows=revived("gateway"),
            ),
        ),
        (
            "scheduler service SIGKILL mid-step",
            lambda: run("scheduler", mid_rollout(), scheduler, shows=restarted),
        ),
        ("trainer core SIGKILL (scheduler)", lambda: run("scheduler", mid_train(), core, shows=restarted)),
    ]


def stop_services(root: Path) -> None:
    from stack.up import down

    for kind in ("colocate", "scheduler"):
        down(str(root / kind))


if __name__ == "__main__":  # one row by hand: python -m bench.faults_campaign "<row name>"
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="gyre-faults-campaign-"))
    try:
        for row_name, job in rows(root, "data/policies/tiny-sft", quick=True):
            if row_name in sys.argv[1:]:
                print(row_name, json.dumps(job(), default=str), flush=True)
    finally:
        stop_services(root)
