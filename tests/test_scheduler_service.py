"""The scheduler service in a campaign: `[scheduler] policy = "elastic"` runs the steps on cells in a
supervised process; SIGKILLed mid-step, it is noticed, killed with everything it started and started
again from the store: the campaign ends with every step committed once, every group member ended
once (none dispatched again after it ended; the attempts live at the kill recorded as abandoned and
run again under new ids), and the restart in the metrics."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from flows.campaign import campaign
from tests.campaign_fixtures import tiny_campaign, tiny_policy, tracked_steps
from trajectory_store.db import connect
from trajectory_store.storage import Store

# one worker for the whole file under `pytest -n`: the kill finds its scheduler by command line
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("scheduler-service")]


def _scheduler_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"tasks.schedule" in argv and b"-m" in argv:
                pids.append(int(entry.name))
    return pids


def _kill_mid_step(store: Store, total: int, killed: list[int], stop: threading.Event) -> None:
    """SIGKILLs the scheduler process once some executions are recorded and some are not."""
    while not stop.is_set():
        table = store.read_table("executions")
        if 0 < table.num_rows < total and _scheduler_pids():
            pid = _scheduler_pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.2)


def test_a_killed_scheduler_is_restarted_from_the_store(prefect_harness, tmp_path):
    config = tiny_campaign(
        "sched",
        tiny_policy(tmp_path / "policy"),
        str(tmp_path / "data"),
        steps=1,
        problems={"per_step": 2},
        dispatch={"durations": {"short_turns": 2, "long_fraction": 0.5, "long_factor": [3.0, 5.0]}},
        serving={"engines": 3},
        scheduler={
            "policy": "elastic",
            "params": {"depth": 1, "min_dwell_s": 1.0, "gain_factor": 0.0},
            "heartbeat_timeout_s": 60,
        },
    )
    store = Store(config.store.model_copy(update={"campaign": config.name}))
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_mid_step, args=(store, 4, killed, stop), daemon=True)
    killer.start()
    try:
        records = campaign(config)
    finally:
        stop.set()
    assert killed, "the scheduler was never seen mid-step"
    assert [r.step for r in records] == [0] and [r.version for r in records] == [1]
    assert not _scheduler_pids(), "a scheduler process outlived the campaign"

    con = connect(store)
    recorded = con.execute(
        "SELECT execution_id, status, count(*) FROM executions_raw GROUP BY ALL"
    ).fetchall()
    restarts = con.execute("SELECT max(value) FROM metrics WHERE name = 'scheduler_restarts'").fetchone()[0]
    phases = con.execute(
        "SELECT name, count(*), min(value) FROM metrics WHERE name LIKE 'switch_to_train_%' AND cell_id IS NOT NULL "
        "GROUP BY name"
    ).fetchall()
    con.close()
    assert {name for name, _, _ in phases} >= {
        "switch_to_train_s",
        "switch_to_train_drain_s",
        "switch_to_train_sleep_s",
    }
    assert all(count >= 1 and low >= 0 for _, count, low in phases)
    assert all(n == 1 for *_, n in recorded), recorded  # every attempt recorded once
    ended = [e for e, status, _ in recorded if status != "abandoned"]
    assert len(ended) == 4 and len({re.sub(r"-a\d+$", "", e) for e in ended}) == 4, recorded  # a member once
    # the executions live when the scheduler died are abandoned; each member's next attempt ended
    for abandoned in [e for e, status, _ in recorded if status == "abandoned"]:
        base = re.sub(r"-a\d+$", "", abandoned)
        assert any(e.startswith(base) and e != abandoned for e in ended), (abandoned, recorded)
    assert restarts == 1.0
    # the step table (the UI's artifact, `gyre run`'s summary) shows each step's executions, the abandoned too
    abandoned = sum(status == "abandoned" for _, status, _ in recorded)
    assert [r.metrics["executions"] for r in records] == [4.0]  # the ended ones
    # the step's packing figures are the step flow's (tasks/steps.py: one recipe), summed over its groups
    packing = {"executions_trained", "executions_packed", "executions_zero_signal", "executions_stale"}
    assert packing <= set(records[0].metrics), sorted(records[0].metrics)
    assert records[0].metrics["executions_packed"] <= 4
    assert sum(r.metrics.get("executions_abandoned", 0) for r in records) == abandoned >= 1
    # MLflow and TensorBoard hold the step once (its scheduler was killed and restarted within it),
    # with its role-switch latency, and both evaluations
    names = ["train/version", "switch/to_train_p50_s", "eval/pass_rate"]
    tracked = tracked_steps(tmp_path / "data" / "tracking", config.name, names)
    assert tracked == {name: (steps, steps) for name, steps in zip(names, ([0], [0], [0, 1]), strict=True)}


def test_a_killed_scheduler_is_noticed_by_its_exit_while_its_children_hold_the_pipe():
    """What the scheduler started (engines, the trainer) keeps its stdout open after it is killed:
    the supervisor notices the exit itself (-9), not a silence at the heartbeat timeout (-1)."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from scheduler.report import Committed, Message
    from tasks.schedule import _watch

    said = Message(committed=Committed(step=2, version=3, wall=1.0)).line()
    program = (
        "import os, signal, subprocess, sys; sys.stdin.readline();"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(20)']);"
        f"print('{{\"heartbeat\": 1}}'); print({said!r}, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    job = SimpleNamespace(wire=lambda: "{}", scheduler=SimpleNamespace(heartbeat_timeout_s=15.0))
    heard = []
    code = _watch(job, lambda message, pid: heard.append(message), [sys.executable, "-c", program])
    # a line that is no message is passed over (logged); the typed one arrives as it was sent
    assert heard == [Message(committed=Committed(step=2, version=3, wall=1.0))]
    assert code == -signal.SIGKILL, code
    leftover = subprocess.run(["pgrep", "-f", "time.sleep\\(20\\)"], capture_output=True, text=True)
    assert not leftover.stdout.strip(), "the killed scheduler's child outlived the supervisor"
