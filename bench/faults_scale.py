"""The fault rows on a setup of their own: the object store stalls (S3 on loopback), 2,000 executions in
one step (a Prefect flow over the campaign's roll-out task), and a satellite SIGKILLed in an elastic
training step (bench/faults.py lists the rows and their figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections import Counter
from typing import Any

import httpx

from bench.faults_step import POLICY, audit, run_step, step_config
from engines.admin import AdminClient, AdminError
from engines.net import free_port
from environments.dispatch_config import DurationProfile
from environments.ledger import step_ledger
from environments.problems import Problem
from environments.runner import ExecutionOutcome
from stack.campaign import Services  # module level: the flow's annotations resolve against it
from stack.stack import local_stack
from tasks.rollout import choose_problems
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig


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
            with AdminClient(stack.gateway_url, stack.admin_token, timeout_s=60) as admin:
                while flushed is None and time.monotonic() < back + 120:
                    with contextlib.suppress(AdminError, httpx.HTTPError):
                        admin.flush()
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
