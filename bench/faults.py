"""`gyre bench faults [--quick]`: faults and load on real processes, each audited for lost and
duplicated work.

Every fault row runs a step of executions against a local stack (two rollout engine processes
serving the shipped tiny policy, the gateway process, a store folder), breaks something, and audits
the step in the store (`audit`):

- lost: group members with no ending (no executions row, or only abandoned attempts), plus calls
  the gateway answered (executions.n_calls) with no row in calls;
- duplicated: members with more than one ending that would be trained (a sample trained twice),
  plus (execution_id, call_id) keys stored twice;
- unended: ids that took calls and have no executions row at all (a status never recorded);
- survived: lost, duplicated and unended are 0 and the row's own check holds.

Rows (what breaks, and what recovery_s measures):
- `dispatcher SIGKILL mid-step`: the process running the step's dispatcher dies with executions
  live; the dispatcher runs again (as the Prefect task's retry does). Recovery: from the kill until
  every member has ended.
- `gateway SIGKILL mid-step`: the gateway dies with executions live and calls not yet flushed; it
  is started again with the same config and the dispatcher runs again. Recovery: from the restart
  until every member has ended.
- `rollout engine SIGKILL mid-decode`: one of the two engine processes dies with calls in flight;
  the gateway reroutes its sessions. Recovery: from the kill to the first call answered after it.
- `harness exits at once`, `harness hangs`, `harness floods the gateway`, `workspace disk quota
  filled`: misbehaving agents, next to well-behaved executions of the same step. Recovery: from the
  fault (the exit, the deadline) to the execution's recorded ending, where there is one.
- `S3 store stopped 30 s`: the store is S3 (moto's server on loopback); it stops while calls are
  being recorded and comes back 30 s later. Recovery: from its return until a flush goes through.
- `2,000 executions in one step`: the campaign's roll-out task in a Prefect flow (an ephemeral
  Prefect server), a one-call curl agent: the Prefect task runs it costs, and every execution in SQL.
- `gateway load`: bench/load_gateway.py (concurrent multi-turn sessions, p50/p99 latency and the
  gateway's own overhead).
- the campaign rows (bench/faults_campaign.py says each): a process of a running `gyre run` campaign
  SIGKILLed (the campaign process, the trainer, the Prefect server, an engine, the gateway, the
  scheduler service, the trainer core under it), audited over every step of the campaign, with
  trained-twice counted by (execution_id, trajectory_id) over the packed batches.
- `satellite SIGKILL mid-step`: an elastic training step whose satellite dies after its first
  micro-batch; lost and duplicated count micro-batches, and the update must equal the core's alone.

`--only PART,...` (processes, s3, big, load, campaign, satellite) runs those parts and writes their
rows in place of the same rows of the output file.

Figures go to bench/results/faults.json: {"rows": [{name, runs, survived, lost, duplicated,
recovery_s, ...}], ...}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, replace
from typing import Any

import httpx

from environments.dispatch import dispatch_missing
from environments.dispatch_config import DispatchConfig, DurationProfile
from environments.ledger import execution_id_for, step_ledger
from environments.problems import Problem
from environments.runner import ExecutionOutcome
from environments.sandbox_host import release_mounts
from tasks.rollout import choose_problems
from tasks.services import Services  # module level: the flow's annotations resolve against it
from tasks.stack import LocalStack, free_port, local_stack, serving_process
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig

DEFAULT_OUT = "bench/results/faults.json"
POLICY = "data/policies/tiny-sft"
SIZES = {
    True: {
        "runs": 1,
        "problems": 3,
        "group_size": 2,
        "stall_s": 30.0,
        "big_step": 200,
        "load_sessions": 64,
        "load_seconds": 20.0,
        "campaign_runs": 1,
    },
    False: {
        "runs": 3,
        "problems": 4,
        "group_size": 4,
        "stall_s": 30.0,
        "big_step": 2000,
        "load_sessions": 256,
        "load_seconds": 120.0,
        "campaign_runs": 1,
    },
}
TRAINABLE = ("completed", "timeout")


# -- the audit -------------------------------------------------------------------------------------


def audit(store: StoreConfig, step: int, *groups: tuple[list[Problem], int]) -> dict[str, int]:
    """Lost, duplicated and unended work of one step (see the module docstring); ``groups``: the
    problems dispatched, each with its group size."""
    ledger = step_ledger(store, step)
    lost = duplicated = abandoned = 0
    members = [
        (problem, member) for problems, size in groups for problem in problems for member in range(size)
    ]
    for problem, member in members:
        endings = []
        for attempt in range(len(ledger.used) + 1):
            execution_id = execution_id_for(step, problem, member, None, attempt)
            if execution_id not in ledger.used:
                break
            row = ledger.ended.get(execution_id)
            if row is not None and row.status == "abandoned":
                abandoned += 1
            elif row is not None:
                endings.append(row)
        lost += not endings
        duplicated += sum(row.status in TRAINABLE for row in endings) > 1
    con = connect(Store(store))
    lost_calls, calls = con.execute(
        """SELECT coalesce(sum(greatest(e.n_calls - coalesce(c.n, 0), 0)), 0), coalesce(sum(c.n), 0)
           FROM executions e
           LEFT JOIN (SELECT execution_id, count(*) AS n FROM calls WHERE step = ? GROUP BY ALL) c
           USING (execution_id) WHERE e.step = ?""",
        [step, step],
    ).fetchone()
    duplicate_calls = con.execute(
        "SELECT count(*) - count(DISTINCT (execution_id, call_id)) FROM calls WHERE step = ?", [step]
    ).fetchone()[0]
    con.close()
    return {
        "lost": lost + int(lost_calls),
        "duplicated": duplicated + int(duplicate_calls),
        "unended": len(ledger.used - set(ledger.ended)),
        "abandoned": abandoned,
        "calls": int(calls),
    }


def survived(counts: dict[str, int], ok: bool = True) -> bool:
    return ok and counts["lost"] == 0 and counts["duplicated"] == 0 and counts["unended"] == 0


# -- running a step --------------------------------------------------------------------------------


def step_config(step: int, group_size: int, root: str, **changes: Any) -> DispatchConfig:
    """Short executions of the tiny policy (two to four turns), four at a time."""
    base = DispatchConfig(
        step=step,
        group_size=group_size,
        concurrency=4,
        timeout_s=60.0,
        workspace_root=f"{root}/ws-{step}",
        durations=DurationProfile(short_turns=3, long_fraction=0.0),
    )
    return replace(base, **changes)


def run_step(
    stack: LocalStack, problems: list[Problem], config: DispatchConfig, on_outcome=None
) -> list[ExecutionOutcome]:
    outcomes, _ = asyncio.run(
        dispatch_missing(problems, stack.gateway_url, stack.admin_token, stack.store, config, on_outcome)
    )
    return outcomes


def dispatcher_job() -> int:
    """`python -m bench.faults --dispatcher`: runs one dispatch_missing from a JSON job on stdin."""
    job = json.load(sys.stdin)
    config = DispatchConfig.from_dict(job["config"])
    problems = [Problem.from_json(p) for p in job["problems"]]
    store = StoreConfig(**job["store"])
    asyncio.run(dispatch_missing(problems, job["gateway_url"], job["admin_token"], store, config))
    return 0


def _stats(stack: LocalStack) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {stack.admin_token}"}
    return httpx.get(f"{stack.gateway_url}/admin/stats", headers=headers, timeout=30).json()


def _row(
    name: str, results: list[tuple[dict[str, int], bool, float | None]], **detail: Any
) -> dict[str, Any]:
    recoveries = [r for _, _, r in results if r is not None]
    return {
        "name": name,
        "runs": len(results),
        "survived": sum(survived(counts, ok) for counts, ok, _ in results),
        "lost": sum(counts["lost"] for counts, _, _ in results),
        "duplicated": sum(counts["duplicated"] for counts, _, _ in results),
        "recovery_s": round(max(recoveries), 2) if recoveries else None,
        "unended": sum(counts["unended"] for counts, _, _ in results),
        "abandoned": sum(counts["abandoned"] for counts, _, _ in results),
        **detail,
    }


# -- the faults ------------------------------------------------------------------------------------


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
        [sys.executable, "-m", "bench.faults", "--dispatcher"], stdin=subprocess.PIPE, start_new_session=True
    )
    process.stdin.write(json.dumps(job).encode())  # type: ignore[union-attr]
    process.stdin.close()  # type: ignore[union-attr]
    total = len(problems) * group_size
    deadline = time.monotonic() + 300
    live_at_kill = 0
    while time.monotonic() < deadline and process.poll() is None:
        ended = step_ledger(stack.store, step).ended
        live_at_kill = _stats(stack)["executions"]
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
        engines = {e["url"]: e for e in _stats(stack).get("engines", [])}
        if step_ledger(stack.store, step).used and engines.get(victim, {}).get("in_flight", 0) > 0:
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
        stats = _stats(stack)
        if stats["executions"] > 0 and stats.get("calls", 0) > 0 and step_ledger(stack.store, step).ended:
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


def s3_stall(problems: list[Problem], group_size: int, root: str, stall_s: float):
    """The store is S3 (moto's server on loopback, the dev dependency); it stops for ``stall_s`` while
    the step's calls are being recorded, then comes back with what it held. The gateway keeps its
    rows buffered until a flush succeeds. Recovery: from the restart until a flush goes through."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # moto takes any; the stack inherits them
        os.environ.setdefault(name, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="gyre-faults")
    store = StoreConfig(data_root="s3://gyre-faults/runs", s3_endpoint_url=endpoint, campaign="stall")
    config = step_config(0, group_size, root, durations=DurationProfile(short_turns=6, long_fraction=0.0))
    outcomes: list[ExecutionOutcome] = []
    try:
        with local_stack(POLICY, store, engines=2) as stack:
            worker = threading.Thread(target=lambda: outcomes.extend(run_step(stack, problems, config)))
            worker.start()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and worker.is_alive() and not step_ledger(store, 0).used:
                time.sleep(0.2)
            server.stop()
            time.sleep(stall_s)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
            server.start()
            back = time.monotonic()
            worker.join()
            flushed = None
            while flushed is None and time.monotonic() < back + 120:
                with contextlib.suppress(httpx.HTTPError):
                    headers = {"Authorization": f"Bearer {stack.admin_token}"}
                    answer = httpx.post(f"{stack.gateway_url}/admin/flush", headers=headers, timeout=60)
                    if answer.status_code == 200:
                        flushed = time.monotonic()
                time.sleep(0.5)
            counts = audit(store, 0, (problems, group_size))
    finally:
        server.stop()
    ok = len(outcomes) == len(problems) * group_size and flushed is not None
    recovery = None if flushed is None else flushed - back
    return counts, ok, recovery, dict(Counter(o.status for o in outcomes))


CURL_AGENT = """#!/bin/bash
# one model call, as cheap as an agent can be: the load is on the dispatcher, the gateway and Prefect
curl -sf -X POST "$1/chat/completions" -H "Authorization: Bearer $2" -H "Content-Type: application/json" \\
  -d '{"model": "any", "messages": [{"role": "user", "content": "one call"}], "max_tokens": 4}' > /dev/null
"""


def big_step(executions: int, root: str) -> tuple[dict[str, int], bool, dict[str, Any]]:
    """One campaign step of ``executions`` executions (groups of 4; a one-call curl agent) as the
    campaign's `roll out step` task in a Prefect flow on an ephemeral Prefect server: coarse tasks keep
    the server's load flat however many executions a step has, and SQL sees every execution."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.testing.utilities import prefect_test_harness
    from pydantic import SecretStr

    from tasks.campaign import roll_out

    script = os.path.join(root, "agent-curl.sh")
    with open(script, "w") as f:
        f.write(CURL_AGENT)
    group = 4
    problems = choose_problems("terminal", executions // group, seed=5)
    store = StoreConfig(data_root=f"{root}/big", campaign="big")
    config = step_config(
        0, group, root, concurrency=16, harness_command=["bash", script, "{base_url}", "{api_key}"]
    )

    @flow(name="big-step", flow_run_name=f"{executions} executions in one step")
    def step_flow(services: Services) -> dict[str, Any]:
        return roll_out([p.to_json() for p in problems], services, store, config, 0)

    async def task_runs(flow_run_id) -> list[str]:
        async with get_client() as client:
            flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            return [t.name for t in await client.read_task_runs(flow_run_filter=flow_filter)]

    with prefect_test_harness(server_startup_timeout=120), local_stack(POLICY, store, engines=1) as stack:
        services = Services(
            gateway_url=stack.gateway_url,
            admin_token=SecretStr(stack.admin_token),
            engine_urls=stack.engine_urls,
            engine_admin_token=SecretStr(stack.engine_admin_token),
            policy_root=f"{root}/big/policy",
            fast_dir=f"{root}/big/fast",
        )
        started = time.monotonic()
        state = step_flow(services, return_state=True)
        seconds = time.monotonic() - started
        tasks = asyncio.run(task_runs(state.state_details.flow_run_id))
    counts = audit(store, 0, (problems, group))
    con = connect(Store(store))
    in_sql = con.execute("SELECT count(*) FROM executions WHERE step = 0").fetchone()[0]
    con.close()
    ok = state.is_completed() and in_sql == executions
    detail = {
        "executions_in_sql": in_sql,
        "prefect_task_runs": len(tasks),
        "step_s": round(seconds, 1),
        "executions_per_minute": round(60 * executions / seconds, 1),
    }
    return counts, ok, detail


def satellite_kill(root: str) -> tuple[dict[str, int], bool, float | None, dict[str, Any]]:
    """An elastic training step (the core and two satellite processes over gloo) in which one satellite
    is SIGKILLed after its first micro-batch: the core recomputes what the dead one held, every
    micro-batch is used once, and the update equals the core's alone (relative difference <= 1e-5)."""
    import io
    from pathlib import Path

    import pyarrow.parquet as pq
    import torch

    from bench.train import _model_folder, workload
    from engines.model.weights import load_model
    from engines.train.config import TrainerConfig
    from engines.train.core import CoreTrainer
    from engines.train.elastic import ElasticCoordinator
    from engines.train.reference import near_policy_behaviour
    from engines.train.satellite import start_satellites
    from trajectory_store.processor import batch_to_table

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread in the core and in each satellite: gradients bitwise alike
    try:
        model_dir = f"{root}/satellite/policy"
        vocab = _model_folder("tiny", model_dir)
        size = {"max_context": 1500, "max_turns": 12, "budget": 0, "executions": 4}
        batch, _ = workload(f"{root}/satellite/data", min(vocab, 4096), size)
        near_policy_behaviour(batch.sequences, load_model(model_dir, dtype="float32"))
        buffer = io.BytesIO()
        pq.write_table(batch_to_table(batch, 0), buffer)
        batch_uri = f"{root}/satellite/batch.parquet"
        Path(batch_uri).write_bytes(buffer.getvalue())
        config = TrainerConfig(lr=1e-3, zero_stage=1, eps=1e-6)
        initial = {
            k: v.detach().clone() for k, v in load_model(model_dir, dtype="float32").state_dict().items()
        }

        def step(satellites: list[dict]):
            core = CoreTrainer(load_model(model_dir, dtype="float32"), config)
            coordinator = ElasticCoordinator(core)
            processes = start_satellites(
                coordinator.host, coordinator.port, model_dir, satellites, pace_s=0.3
            )
            weights_dir = f"{root}/satellite/fast-{len(satellites)}"
            os.makedirs(weights_dir, exist_ok=True)
            report = coordinator.run_step(
                0,
                batch.sequences,
                len(batch.advantages),
                batch_uri=batch_uri,
                weights_dir=weights_dir,
                pace_s=0.3 if satellites else 0.0,
            )
            for process in processes:
                process.join(timeout=60)
            coordinator.close()
            return core.weights(), report, [p.exitcode for p in processes]

        reference, _, _ = step([])
        weights, report, exitcodes = step([{"die_after": 1}, {}])
    finally:
        torch.set_num_threads(threads)
    num = den = 0.0
    for name, ref in reference.items():
        num += float((weights[name] - ref).double().pow(2).sum())
        den += float((ref - initial[name]).double().pow(2).sum())
    diff = (num / den) ** 0.5
    used = Counter(i for ids in report.by_participant.values() for i in ids)
    counts = {
        "lost": sum(1 for i in range(report.micro_batches) if used[i] == 0),
        "duplicated": sum(1 for n in used.values() if n > 1),
        "unended": 0,
        "abandoned": 0,
    }
    ok = -signal.SIGKILL in exitcodes and len(report.dead) == 1 and diff <= 1e-5
    detail = {
        "micro_batches": report.micro_batches,
        "recomputed_by_core": len(report.recomputed),
        "satellite_exit_codes": exitcodes,
        "update_rel_diff_vs_core_alone": diff,
    }
    return counts, ok, None, detail  # nothing to wait for: the step ends with the core's recomputation


# -- the benchmark ---------------------------------------------------------------------------------


PARTS = ("processes", "s3", "big", "load", "campaign", "satellite")


def run(quick: bool, parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """The rows of ``parts``: processes (misbehaving harnesses, dispatcher, gateway and engine kills on a
    local stack), s3 (the store stalls), big (the 2,000-execution step), load (the gateway), campaign
    (processes of a running campaign killed: bench/faults_campaign.py), satellite (an elastic step)."""
    size = SIZES[quick]
    root = tempfile.mkdtemp(prefix="gyre-faults-")
    rows = []
    started = time.monotonic()
    if "processes" in parts:
        rows += process_rows(size, root)
    problems = choose_problems("mixed", size["problems"], seed=11)
    if "s3" in parts:
        counts, ok, recovery, statuses = s3_stall(problems, size["group_size"], root, size["stall_s"])
        name = f"S3 store stopped {size['stall_s']:.0f} s"
        rows.append(_row(name, [(counts, ok, recovery)], statuses=statuses))
        print(json.dumps(rows[-1]), flush=True)
    if "big" in parts:
        counts, ok, detail = big_step(size["big_step"], root)
        rows.append(_row(f"{size['big_step']:,} executions in one step", [(counts, ok, None)], **detail))
        print(json.dumps(rows[-1]), flush=True)
    if "load" in parts:
        from bench.load_gateway import gateway_load

        load = gateway_load(size["load_sessions"], size["load_seconds"], root=f"{root}/load")
        rows.append({**load, "recovery_s": None})  # nothing breaks: nothing to recover from
        print(json.dumps(rows[-1]), flush=True)
    if "campaign" in parts:
        rows += campaign_rows(size, root)
    if "satellite" in parts:
        counts, ok, recovery, detail = satellite_kill(root)
        rows.append(_row("satellite SIGKILL mid-step", [(counts, ok, recovery)], **detail))
        print(json.dumps(rows[-1]), flush=True)
    return {
        "quick": quick,
        "rows": rows,
        "all_survived": all(r["survived"] == r["runs"] for r in rows),
        "wall_s": round(time.monotonic() - started, 1),
    }


def campaign_rows(size: dict[str, Any], root: str) -> list[dict[str, Any]]:
    from pathlib import Path

    from bench import faults_campaign

    folder = Path(root) / "campaign"
    folder.mkdir()
    rows = []
    try:
        for name, job in faults_campaign.rows(folder, POLICY, quick=size["runs"] == 1):
            results, details = [], []
            for _ in range(size["campaign_runs"]):
                counts, ok, recovery, detail = job()
                results.append((counts, ok, recovery))
                details.append(detail)
            rows.append(_row(name, results, detail=details))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        faults_campaign.stop_services(folder)
    return rows


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
            rows.append(_row(name, results, detail=details))
            print(json.dumps(rows[-1]), flush=True)
        results = []
        for _ in range(size["runs"]):
            results.append(kill_dispatcher(stack, problems, size["group_size"], step, root))
            step += 1
        rows.append(_row("dispatcher SIGKILL mid-step", results))
        print(json.dumps(rows[-1]), flush=True)
        results = []
        for _ in range(size["runs"]):
            results.append(kill_gateway(stack, problems, size["group_size"], step, root, keep))
            step += 1
        rows.append(_row("gateway SIGKILL mid-step", results))
        print(json.dumps(rows[-1]), flush=True)
        # last: it leaves one engine
        counts, ok, recovery, statuses = kill_engine(stack, problems, size["group_size"], step, root)
        rows.append(
            _row("rollout engine SIGKILL mid-decode", [(counts, ok, recovery)], statuses=dict(statuses))
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def print_table(figures: dict[str, Any]) -> None:
    print(f"{'fault or load':<36} {'runs':>4} {'survived':>8} {'lost':>5} {'dup':>4} {'recovery s':>10}")
    for row in figures["rows"]:
        recovery = "-" if row["recovery_s"] is None else f"{row['recovery_s']:.2f}"
        print(
            f"{row['name']:<36} {row['runs']:>4} {row['survived']:>8} {row['lost']:>5} "
            f"{row['duplicated']:>4} {recovery:>10}"
        )


def merged(figures: dict[str, Any], out: str, only: tuple[str, ...]) -> dict[str, Any]:
    """``figures``' rows in place of the same rows of the file ``out`` (the other rows kept, in order):
    what `--only` writes. Each row says when it was measured and whether quick."""
    try:
        with open(out) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return figures
    new = {row["name"]: row for row in figures["rows"]}
    rows = [new.pop(row["name"], row) for row in old.get("rows", [])] + list(new.values())
    run = {"parts": list(only), "wall_s": figures["wall_s"], "measured": time.strftime("%Y-%m-%d")}
    return {
        **old,  # wall_s stays the full run's
        "rows": rows,
        "all_survived": all(r["survived"] == r["runs"] for r in rows),
        "only_runs": [*old.get("only_runs", []), run],
    }


def main(quick: bool = False, out: str = DEFAULT_OUT, only: tuple[str, ...] = ()) -> int:
    unknown = set(only) - set(PARTS)
    if unknown:
        raise ValueError(f"--only: unknown part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    figures = run(quick, tuple(only) or PARTS)
    stamp = time.strftime("%Y-%m-%d")
    for row in figures["rows"]:
        row |= {"measured": stamp, "quick": quick}
    if only:
        figures = merged(figures, out, only)
    print_table(figures)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(figures, f, indent=2)
    print(f"wrote {out}")
    return 0 if figures["all_survived"] else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--dispatcher"]:
        sys.exit(dispatcher_job())
    only = tuple(a.removeprefix("--only=") for a in sys.argv[1:] if a.startswith("--only="))
    sys.exit(main(quick="--quick" in sys.argv, only=tuple(p for o in only for p in o.split(","))))
