"""The fault rows on one local stack (two rollout engine processes serving the shipped tiny policy, the
gateway process, a store folder): misbehaving harnesses beside well-behaved ones, and the dispatcher,
the gateway and an engine SIGKILLed mid-step (bench/faults.py lists the rows and their figures).

    python -m bench.faults_processes --dispatcher    # one dispatch_missing from a JSON job on stdin:
                                                     # the process kill_dispatcher kills
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

from bench.faults_step import POLICY, TRAINABLE, audit, run_step, step_config, tally
from engines.admin import AdminClient, GatewayStatsReport
from environments.dispatch import dispatch_missing
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.ledger import step_ledger
from environments.problems import Problem
from environments.runner import ExecutionOutcome
from environments.sandbox_host import release_mounts
from stack.stack import LocalStack, local_stack, serving_process
from tasks.rollout import choose_problems
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig


def dispatcher_job() -> int:
    """`python -m bench.faults_processes --dispatcher`: runs one dispatch_missing from a JSON job on stdin."""
    job = json.load(sys.stdin)
    config = DispatchConfig.from_dict(job["config"])
    problems = [Problem.from_json(p) for p in job["problems"]]
    store = StoreConfig(**job["store"])
    asyncio.run(dispatch_missing(problems, job["gateway_url"], job["admin_token"], store, config))
    return 0


def gateway_stats(stack: LocalStack) -> GatewayStatsReport:
    with AdminClient(stack.gateway_url, stack.admin_token, timeout_s=30) as admin:
        return admin.gateway_stats()


def kill_dispatcher(stack: LocalStack, problems: list[Problem], group_size: int, step: int, root: str):
    """SIGKILLs a dispatcher process once some of the step's executions ended and others are live,
    then runs the dispatcher again; the dead one's live executions become abandoned attempts."""
    config = step_config(step, group_size, root, concurrency=2)
    job = {
        "config": asdict(config),
        "problems": [p.to_json() for p in problems],
        "store": stack.store.model_dump(),
        "gateway_url": stack.gateway_url,
        "admin_token": stack.admin_token,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.faults_processes", "--dispatcher"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    process.stdin.write(json.dumps(job).encode())  # type: ignore[union-attr]
    process.stdin.close()  # type: ignore[union-attr]
    total = len(problems) * group_size
    deadline = time.monotonic() + 300
    live_at_kill = 0
    while time.monotonic() < deadline and process.poll() is None:
        ended = step_ledger(stack.store, step).ended
        live_at_kill = gateway_stats(stack).executions
        if 0 < len(ended) < total and live_at_kill > 0:
            break
        time.sleep(0.2)
    killed = time.monotonic()
    mid_step = process.poll() is None
    with contextlib.suppress(
        ProcessLookupError
    ):  # the dispatcher; its harnesses run in sessions of their own
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    run_step(stack, problems, config)
    recovery = time.monotonic() - killed
    release_mounts(config.workspace_root)  # the dead dispatcher's sandboxes were never released
    counts = audit(stack.store, step, (problems, group_size))
    return counts, mid_step and live_at_kill > 0 and counts["abandoned"] >= 1, recovery


def kill_engine(stack: LocalStack, problems: list[Problem], group_size: int, step: int, root: str):
    """SIGKILLs the second engine process while calls are in flight; the step must still end with
    every execution completed (or timed out), none failed by the engine's death."""
    config = step_config(step, group_size, root, durations=DurationProfile(short_turns=6, long_fraction=0.0))
    victim = stack.engine_urls[-1]
    outcomes: list[ExecutionOutcome] = []
    worker = threading.Thread(target=lambda: outcomes.extend(run_step(stack, problems, config)))
    worker.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and worker.is_alive():
        engines = {e.url: e for e in gateway_stats(stack).engines}
        if step_ledger(stack.store, step).used and victim in engines and engines[victim].in_flight > 0:
            break
        time.sleep(0.1)
    killed_wall = time.time()
    stack.processes[victim].kill()
    worker.join()
    counts = audit(stack.store, step, (problems, group_size))
    con = connect(Store(stack.store))
    first_after = con.execute(
        "SELECT min(t_end) FROM calls WHERE step = ? AND t_end > ?", [step, killed_wall]
    ).fetchone()[0]
    con.close()
    ok = all(o.status in TRAINABLE for o in outcomes) and len(outcomes) == len(problems) * group_size
    recovery = None if first_after is None else first_after - killed_wall
    return counts, ok, recovery, Counter(o.status for o in outcomes)


def kill_gateway(
    stack: LocalStack,
    problems: list[Problem],
    group_size: int,
    step: int,
    root: str,
    keep: contextlib.ExitStack,
):
    """SIGKILLs the gateway with executions live and calls not yet flushed, starts it again with the
    same config (by hand: nothing restarts a gateway by itself yet) and runs the dispatcher again.
    The spool gives the new gateway every call the dead one answered; the attempts that were live
    are abandoned and run again. Recovery: from the restart until every member has ended. ``keep``
    holds the new gateway process until the caller is done with the stack."""
    config = step_config(step, group_size, root, durations=DurationProfile(short_turns=6, long_fraction=0.0))
    failed: list[BaseException] = []

    def first_try() -> None:
        try:
            run_step(stack, problems, config)
        except BaseException as error:  # the gateway died under it: the step fails, as a task would
            failed.append(error)

    worker = threading.Thread(target=first_try)
    worker.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and worker.is_alive():
        stats = gateway_stats(stack)
        if stats.executions > 0 and stats.calls > 0 and step_ledger(stack.store, step).ended:
            break
        time.sleep(0.2)
    gateway = stack.processes[stack.gateway_url]
    gateway.kill()
    gateway.wait()
    worker.join()
    command = [sys.executable, "-m", "engines.gateway", "--config", "-"]
    again = serving_process(command, stack.gateway_url, dict(os.environ), stdin=stack.gateway_config)
    stack.processes[stack.gateway_url] = keep.enter_context(again)  # it serves the rows after this one
    back = time.monotonic()
    run_step(stack, problems, config)
    recovery = time.monotonic() - back
    release_mounts(config.workspace_root)  # the failed first try's sandboxes
    counts = audit(stack.store, step, (problems, group_size))
    return counts, bool(failed) and counts["abandoned"] >= 1, recovery


AGENTS = {
    "exit": "import sys; sys.exit(3)",
    "hang": "import time; time.sleep(3600)",
    "flood": """
import sys, concurrent.futures, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=60)
def call(i):
    try:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": f"flood {i}"}], max_tokens=4)
        return "ok"
    except openai.APIStatusError as error:
        return str(error.status_code)
    except openai.APIError as error:
        return type(error).__name__
with concurrent.futures.ThreadPoolExecutor(64) as pool:
    results = list(pool.map(call, range(256)))
print({r: results.count(r) for r in set(results)})
""",
    "fill": """
import os, sys
path, quota, written = os.path.join(sys.argv[1], "fill.bin"), int(sys.argv[2]), 0
try:
    with open(path, "wb") as out:
        while written < (1 << 31):
            out.write(b"x" * (1 << 20)); out.flush(); written += 1 << 20
except OSError as error:
    print("stopped at", written, "bytes:", error)
    sys.exit(0 if written <= quota else 4)  # completed only when the quota held
print("never stopped:", written)
sys.exit(5)
""",
}


def misbehaving(
    stack: LocalStack, problems: list[Problem], group_size: int, step: int, root: str, agent: str
) -> tuple[dict[str, int], bool, float | None, dict[str, Any]]:
    """One misbehaving execution per problem beside well-behaved ones of the same step: the bad ones
    end with a recorded status, the good ones complete, and nothing is lost."""
    script = os.path.join(root, f"agent-{agent}.py")  # a file: the command is a format template
    with open(script, "w") as f:
        f.write(AGENTS[agent])
    quota = 32 << 20
    command = [sys.executable, script] + {
        "exit": [],
        "hang": [],
        "flood": ["{base_url}", "{api_key}"],
        "fill": ["{workspace}", str(quota)],
    }[agent]
    timeout_s = 8.0 if agent == "hang" else 120.0
    bad = [Problem(**{**p.to_json(), "problem_id": f"{p.problem_id}-{agent}"}) for p in problems[:1]]
    bad_config = step_config(
        step,
        1,
        root,
        harness_command=command,
        timeout_s=timeout_s,
        workspace_disk_bytes=quota,
        workspace_root=f"{root}/ws-{step}-bad",
    )
    good_config = step_config(step, group_size, root)
    started = time.monotonic()

    async def both() -> tuple[list[ExecutionOutcome], list[ExecutionOutcome]]:
        args = (stack.gateway_url, stack.admin_token, stack.store)
        (bad_out, _), (good_out, _) = await asyncio.gather(
            dispatch_missing(bad, *args, bad_config), dispatch_missing(problems, *args, good_config)
        )
        return bad_out, good_out

    bad_out, good_out = asyncio.run(both())
    counts = audit(stack.store, step, (bad, 1), (problems, group_size))
    expected = {"exit": "error", "hang": "timeout", "flood": "completed", "fill": "completed"}[agent]
    ok = all(o.status == expected for o in bad_out) and all(o.status in TRAINABLE for o in good_out)
    recovery = None
    if agent == "hang":  # past the deadline: kill, snapshot, grade, record
        recovery = max(o.duration_s for o in bad_out) - timeout_s
    elif agent == "exit":
        recovery = max(o.duration_s for o in bad_out)
    detail = {
        "bad_status": dict(Counter(o.status for o in bad_out)),
        "good_status": dict(Counter(o.status for o in good_out)),
        "step_s": round(time.monotonic() - started, 2),
    }
    if agent == "fill":  # the agent exits 0 only if its writes stopped within the quota
        detail["quota_bytes"] = quota
    return counts, ok, recovery, detail


def process_rows(size: dict[str, Any], root: str) -> list[dict[str, Any]]:
    store = StoreConfig(data_root=f"{root}/store", campaign="faults")
    problems = choose_problems("mixed", size["problems"], seed=11)
    rows = []
    step = 0
    with local_stack(POLICY, store, engines=2) as stack, contextlib.ExitStack() as keep:
        for agent, name in (
            ("exit", "harness exits at once"),
            ("hang", "harness hangs"),
            ("flood", "harness floods the gateway"),
            ("fill", "workspace disk quota filled"),
        ):
            results, details = [], []
            for _ in range(size["runs"]):
                counts, ok, recovery, detail = misbehaving(
                    stack, problems, size["group_size"], step, root, agent
                )
                results.append((counts, ok, recovery))
                details.append(detail)
                step += 1
            rows.append(tally(name, results, detail=details))
            print(json.dumps(rows[-1]), flush=True)
        results = []
        for _ in range(size["runs"]):
            results.append(kill_dispatcher(stack, problems, size["group_size"], step, root))
            step += 1
        rows.append(tally("dispatcher SIGKILL mid-step", results))
        print(json.dumps(rows[-1]), flush=True)
        results = []
        for _ in range(size["runs"]):
            results.append(kill_gateway(stack, problems, size["group_size"], step, root, keep))
            step += 1
        rows.append(tally("gateway SIGKILL mid-step", results))
        print(json.dumps(rows[-1]), flush=True)
        # last: it leaves one engine
        counts, ok, recovery, statuses = kill_engine(stack, problems, size["group_size"], step, root)
        rows.append(
            tally("rollout engine SIGKILL mid-decode", [(counts, ok, recovery)], statuses=dict(statuses))
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1:] != ["--dispatcher"]:
        sys.exit("usage: python -m bench.faults_processes --dispatcher < job.json")
    sys.exit(dispatcher_job())
