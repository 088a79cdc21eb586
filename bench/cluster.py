"""A campaign whose cells run on test hosts, measured: what `gyre bench hosts` reports under `campaign`,
and what tests/test_cluster.py checks.

    figures = campaign_on_hosts(workdir, cells=[1, 1, 1], cut="h3")

Hosts h1..hN are network namespaces (bench/netns.py); ``cells[i]`` cells are placed on host i+1. The
Prefect server and the S3 store (moto) listen on the root namespace's address on the hosts' network,
and so does the campaign's gateway; the campaign process (the dispatcher, the harness, the trainer)
runs in the root namespace. Each host runs one process worker of its pool, which runs that host's
cells (flows/cell.py). The campaign is colocate: every step rolls out on every cell, then trains.

With ``cut``, that host's link goes down once its first cell serves version 1 and holds sessions
(step 1 rolls out there; ``cut_step=0``: version 0, after the baseline evaluation): the cell fleet
finds the host's worker silent, marks its cells crashed and starts them again on the other hosts
with the version served; calls in flight there re-run elsewhere from their recorded prompts.

The figures: step times, the bytes that crossed each host's link (its interface counters: weights
from S3, calls and answers, health checks, Prefect), and with a cut host, when it was found lost
(``found_lost_s``) and when its cells served again elsewhere (``recovery_s``), both from the cut;
executions lost (dispatched but not recorded, or recorded with fewer calls than they made), calls
recorded twice, and executions trained in more than one step.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq

from bench.netns import TestHost, cut_off, hosts, root_address
from bench.servers import prefect_server, s3_server
from deployments.cells import deploy_cells
from deployments.deploy import ROOT, worker_command
from engines.admin import AdminClient
from environments.gateways import STANDBY_CALL_BASE
from sim.calibrate import Execution, MeasuredRun, core_compute_s

STEPS = 2
PER_STEP = 3  # problems a step, each a group of 2: 6 executions a step
HEARTBEAT_S = 2  # the workers' heartbeat (Prefect's default is 30 s)


def campaign_config(
    name: str, policy: str, data_root: str, cluster: dict[str, Any], scheduler: dict[str, Any] | None = None
):
    """The campaign's config; with ``cluster["core_hosts"]`` its core's optimizer state is split across
    the ranks (ZeRO 1); with ``scheduler``, its [scheduler] section (the cells switch roles)."""
    from flows.config import CampaignConfig

    return CampaignConfig.model_validate(
        {
            **({"scheduler": scheduler} if scheduler else {}),
            "name": name,
            "policy": policy,
            "steps": STEPS,
            "store": {"data_root": data_root},
            "packing": {"token_budget": 8192},
            "problems": {"suites": ["terminal"], "per_step": PER_STEP, "zero_signal": "keep"},
            "evaluation": {"per_suite": 1},
            "dispatch": {
                "group_size": 2,
                "concurrency": 2 * PER_STEP,
                "timeout_s": 120,
                "durations": {"short_turns": 3, "long_fraction": 0.0},
                "harness": {"max_tokens": 24, "max_retries": 0, "max_subagents": 0},
            },
            "trainer": {"lr": 1e-4, "zero_stage": 1 if cluster.get("core_hosts") else 0},
            "serving": {"trainer_threads": 1},
            "cluster": cluster,
        }
    )


def link_bytes(host: TestHost) -> int:
    """Bytes received and sent on the host's link so far (0 on a loopback host)."""
    if host.netns is None:
        return 0
    out = subprocess.run(
        ["ip", "-n", host.netns, "-s", "-j", "link", "show", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    link = json.loads(out)[0]["stats64"]
    return int(link["rx"]["bytes"]) + int(link["tx"]["bytes"])


def campaign_on_hosts(
    workdir: Path,
    cells: list[int],
    cut: str | None = None,
    cut_step: int = 1,
    heartbeat_misses: int = 3,
    gateways: int = 1,
    kill_gateway: bool = False,
    core_hosts: tuple[str, ...] = (),
    scheduler: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs the campaign with ``cells[i]`` cells on host h<i+1>, cutting host ``cut`` off during step
    ``cut_step`` (0 or 1); its figures, and the checks of what it recorded (see the module's docstring).
    ``heartbeat_misses``: [cluster]'s (a test on a loaded machine gives the workers more slack).
    ``gateways``: [cluster]'s; ``kill_gateway``: SIGKILL the last gateway during step 0, once it has
    answered its first call (its executions go on at their standby; the campaign starts it again);
    ``core_hosts``: [cluster]'s (a rank of the core on each of them every step); ``scheduler``: the
    campaign's [scheduler] section (its cells switch roles; each also serves a trainer replica);
    ``overrides``: a partial campaign config merged over the bench's (another workload)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from engines.model import ModelConfig, init_model
    from flows.campaign import campaign, campaign_store
    from tasks.commit import committed_evaluations
    from trajectory_store.config import SelectionConfig
    from trajectory_store.db import connect
    from trajectory_store.storage import Store

    policy = str(workdir / "policy")
    init_model(ModelConfig(preset="tiny", seed=0), policy)
    names = [f"h{i + 1}" for i in range(len(cells))]
    with contextlib.ExitStack() as stack:
        test_hosts = stack.enter_context(hosts(names))
        by_name = {h.name: h for h in test_hosts}
        if cut is not None and by_name[cut].netns is None:
            raise RuntimeError("a host can be cut off only in a network namespace (this machine gives none)")
        root = root_address(test_hosts[0])
        bucket, _ = stack.enter_context(s3_server(root))
        api_url, env = stack.enter_context(prefect_server(workdir / "prefect", host=root))
        stack.enter_context(temporary_settings({PREFECT_API_URL: api_url}))
        cluster = {
            "hosts": [
                {"name": h.name, "address": h.address, "cells": n}
                for h, n in zip(test_hosts, cells, strict=True)
            ],
            "gateway_address": root,
            "gateways": gateways,
            "heartbeat_misses": heartbeat_misses,
            "watch_interval_s": 1.0,
            "core_hosts": list(core_hosts),
        }
        config = campaign_config("across", policy, f"s3://{bucket}/data", cluster, scheduler)
        if overrides:
            config = config.merged(overrides)
        deploy_cells(config.cluster)
        worker_env = {
            **env,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_HEARTBEAT_SECONDS": str(HEARTBEAT_S),
        }
        for host in test_hosts:
            stack.callback(stop_process, start_worker(host, f"gyre-{host.name}", worker_env))

        result: dict[str, Any] = {}
        context = contextvars.copy_context()  # the campaign's thread talks to this Prefect server

        def run() -> None:
            try:
                result["records"] = context.run(campaign, config)
            except BaseException as exc:  # reported below
                result["error"] = exc

        bytes_before = {h.name: link_bytes(h) for h in test_hosts}
        started = time.monotonic()
        thread = threading.Thread(target=run, name="campaign")
        thread.start()
        killing = _kill_gateway_during_step_0(config, thread, result) if kill_gateway else {}
        cutting = _cut_during(by_name[cut], cut_step, config, thread, result) if cut else {}
        thread.join(1800)
        if thread.is_alive() or "error" in result:
            raise RuntimeError(f"the campaign on {len(cells)} hosts failed: {result.get('error')!r}")
        wall_s = time.monotonic() - started
        link = {h.name: link_bytes(h) - bytes_before[h.name] for h in test_hosts}
        # the campaign cancelled its cells: their workers stop them and their engines (the cut host's
        # cell cannot hear it: it is fenced once its link is back)
        left = _listening([h for h in test_hosts if h.name != cut], timeout_s=60)

        records = result["records"]
        store, _ = campaign_store(config)
        target = Store(store)
        con = connect(target, SelectionConfig())
        executions = con.sql("SELECT count(*), count(DISTINCT execution_id) FROM executions").fetchall()[0]
        calls = con.sql("SELECT count(*), count(DISTINCT (execution_id, call_id)) FROM calls").fetchall()[0]
        # n_calls: the calls the gateways that took the finish answered (a killed one's are not
        # counted there, but its spool writes them): fewer calls in the store is a loss
        short = con.sql(
            "SELECT count(*) FROM executions e WHERE n_calls > "
            "(SELECT count(*) FROM calls c WHERE c.execution_id = e.execution_id)"
        ).fetchall()[0][0]
        evaluations = committed_evaluations(store)
        at_standby = con.sql(
            f"SELECT count(DISTINCT execution_id) FROM calls WHERE call_id >= {STANDBY_CALL_BASE}"
        ).fetchall()[0][0]
        versions = dict(
            con.sql("SELECT step, list(DISTINCT policy_version) FROM calls GROUP BY ALL").fetchall()
        )
        trained: dict[str, int] = {}
        for step in range(len(records)):  # the step's batch, or the scheduler's chunk of each group
            for path in target.fs.glob(target.path(f"batches/step={step}/*.parquet")):
                table = pq.read_table(io.BytesIO(target.read_bytes(path)), columns=["executions"])
                for execution in {e for row in table.column("executions").to_pylist() for e in row}:
                    trained[execution] = trained.get(execution, 0) + 1
        executions_a_step = config.problems.per_step * config.dispatch.group_size
        measured = measured_run(con, records, 2, -(-executions_a_step // sum(cells)), set(trained))
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["gyre-cell"])))
            core_runs = {
                r.name: r.state.type.value
                for r in client.read_flow_runs(
                    flow_filter=FlowFilter(name=FlowFilterName(any_=["gyre-core-rank"]))
                )
            }
        cell_runs = {
            r.name: {
                "state": r.state.type.value,
                "message": r.state.message or "",
                "policy": r.parameters["policy"],
            }
            for r in runs
        }

    dispatched = len(records) * executions_a_step
    step_s = [round(r.metrics["step_s"], 2) for r in records]
    # the steps from the first's start to the last's commit (a scheduler's steps overlap)
    span = records[-1].committed_at - min(r.committed_at - r.metrics["step_s"] for r in records)
    return {
        "hosts": len(cells),
        "cells": dict(zip(names, cells, strict=True)),
        "namespaces": test_hosts[0].netns is not None,
        "bucket": bucket,
        "steps": len(records),
        "step_s": step_s,
        "step_s_mean": round(sum(step_s) / len(step_s), 2),
        "steps_span_s": round(span, 2),
        "held_out": evaluations.get(max(evaluations, default=-1), {}),  # the last version's evaluation
        "wall_s": round(wall_s, 1),
        "executions": executions[0],
        "executions_lost": dispatched - executions[1] + short,
        "executions_recorded_twice": executions[0] - executions[1],
        "calls_recorded_twice": calls[0] - calls[1],
        "trained_twice": sum(1 for n in trained.values() if n > 1),
        "executions_packed": [int(r.metrics["executions_packed"]) for r in records],
        "left_out_by_step": [  # why a step packed fewer than all its executions
            {
                k: int(v)
                for k, v in r.metrics.items()
                if k.startswith("executions_") and v and k != "executions_trained"
            }
            for r in records
        ],
        "call_versions_by_step": {int(k): sorted(v) for k, v in versions.items()},
        "bytes_on_host_links": link,
        "engines_left_listening": left,
        "bytes_between_hosts_per_step": round(sum(link.values()) / max(len(records), 1)),
        "cell_runs": cell_runs,
        "core_ranks": [int(r.metrics.get("core_ranks", 1)) for r in records],
        # under a scheduler: its switches, and the micro-batches computed off the core (replicas on hosts)
        "switches_by_step": [int(r.metrics.get("switches", 0)) for r in records],
        "satellites_by_step": [int(r.metrics.get("satellites", 0)) for r in records],
        "cells_moved_by_step": [int(r.metrics.get("cells_moved", 0)) for r in records],
        "micro_batches_off_core": [
            int(r.metrics.get("micro_batches", 0) - r.metrics.get("core_micro_batches", 0)) for r in records
        ],
        "measured": measured,
        "core_rank_runs": core_runs,
        "gateways": gateways,
        "executions_went_on_at_standby": at_standby,
        **killing,
        **cutting,
    }


def measured_run(
    con, records: list, group_size: int, sessions_per_cell: int, trained: set[str] | None = None
) -> MeasuredRun:
    """The campaign's steps as the simulator's calibration reads a real run (sim/calibrate.py): each
    execution's calls, tokens, call and wall time from the store, the tokens it gave training (those
    of the executions in ``trained``, the steps' batches: with zero_signal = "keep" a group without a
    signal trains too; None: those of groups with a signal), each step's time after its roll-out
    and the core's own compute (its step's compute less its waits for arrivals: the training rate).
    Its switches are left at 0: what a step spends serving its version (the weights pulled over the
    hosts' links) is inside its roll-out; `bench/hosts.py` names it."""
    rows = con.sql(
        """
        SELECT e.step, e.execution_id, e.group_id, e.reward, e.ended_at - e.started_at,
               list(c.output_len ORDER BY c.call_id), list(c.prompt_len ORDER BY c.call_id),
               coalesce(sum(c.t_end - c.t_start), 0), coalesce(sum(c.prompt_len + c.output_len - c.prefix_len), 0)
        FROM executions e LEFT JOIN calls c USING (execution_id)
        WHERE e.status <> 'abandoned'
        GROUP BY ALL ORDER BY e.step, e.group_id, e.execution_id
        """
    ).fetchall()
    rewards: dict[tuple[int, str], set[float]] = {}
    for step, _, group, reward, *_ in rows:
        rewards.setdefault((step, group), set()).add(round(reward or 0.0, 6))
    steps: list[list[Execution]] = [[] for _ in records]
    for step, execution_id, group, _, wall, outputs, prompts, call_s, unique in rows:
        packed = execution_id in trained if trained is not None else len(rewards[(step, group)]) > 1
        steps[step].append(Execution.recorded(outputs, prompts, call_s, wall, unique if packed else 0.0))
    return MeasuredRun(
        policy="colocate",
        group_size=group_size,
        executions=steps,
        makespan_s=sum(r.metrics["step_s"] for r in records),
        post_rollout_s=[r.metrics["train_s"] for r in records],
        to_train_s=0.0,
        to_rollout_s=0.0,
        sessions_per_cell=sessions_per_cell,
        core_compute_s=[core_compute_s(r.metrics) for r in records],
    )


def _kill_gateway_during_step_0(config, thread: threading.Thread, result: dict) -> dict[str, Any]:
    """SIGKILLs the campaign's last gateway once it has answered its first call of step 0's roll-out
    (after the baseline evaluation, whose executions belong to another campaign; its executions then
    have calls left to make); then waits until the campaign has started it again (its /health
    answers) with the cells' engines."""
    from prefect.blocks.system import Secret

    from stack.campaign import running_cluster_stacks

    deadline = time.monotonic() + 600
    while not running_cluster_stacks():
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the campaign's gateways never served: {result.get('error')!r}")
        time.sleep(0.5)
    stack = running_cluster_stacks()[0]
    url = stack.gateway_urls[-1]
    tokens = Secret.load(running_fleets_order_block()).get()
    while not _evaluated_version_0(config):  # not during it: the evaluation's calls are another campaign's
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"step 0 never rolled out: {result.get('error')!r}")
        time.sleep(0.2)
    with AdminClient(url, tokens["admin_token"], tokens["engine_admin_token"]) as admin:
        before = admin.gateway_stats().calls
        while (calls := admin.gateway_stats().calls) <= before:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway {url} never took a call: {result.get('error')!r}")
            time.sleep(0.1)
        process = stack.processes[url]
        process.kill()
        process.wait()
        killed_at = time.monotonic()
        while True:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway {url} was not started again: {result.get('error')!r}")
            if stack.processes[url] is not process:
                with contextlib.suppress(httpx.HTTPError):
                    if admin.gateway_stats().engines:
                        break
            time.sleep(0.2)
    return {
        "gateway_killed": url,
        "gateway_calls_before_kill": calls,
        "gateway_serving_again_s": round(time.monotonic() - killed_at, 2),
    }


def _evaluated_version_0(config) -> bool:
    """Whether the campaign has recorded its baseline evaluation in its store: the gateways' next
    calls are step 0's. (Read from the store, not from the evaluation task's state in Prefect: task
    states reach the API late, and under load a whole step could pass before one is seen.)"""
    from flows.campaign import campaign_store
    from tasks.commit import committed_evaluations

    return 0 in committed_evaluations(campaign_store(config)[0])


def running_fleets_order_block() -> str:
    """The Secret block holding the running campaign's admin tokens."""
    from stack.campaign import running_fleets

    return running_fleets()[0].order.tokens_block


def _cut_during(host: TestHost, step: int, config, thread: threading.Thread, result: dict) -> dict[str, Any]:
    """Cuts ``host`` off once its first cell serves version ``step`` and holds sessions (``step``
    rolls out there: for step 0, once the baseline evaluation is recorded); then waits until the
    fleet has found it lost and its cells serve again elsewhere."""
    if step not in (0, 1):
        raise ValueError(f"a host is cut off during step 0 or 1 of the bench's two; got {step}")
    from prefect.blocks.system import Secret

    from stack.campaign import running_fleets

    deadline = time.monotonic() + 900

    def alive(what: str) -> None:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {result.get('error')!r}")

    while not running_fleets():
        alive("the campaign's cells never served")
        time.sleep(0.5)
    fleet = running_fleets()[0]
    mine = sorted(c.cell_id for c in fleet.cells.values() if c.host == host.name)
    tokens = Secret.load(fleet.order.tokens_block).get()
    gateways = [fleet.order.gateway_url, *fleet.order.more_gateways]
    with AdminClient(fleet.order.gateway_url, tokens["admin_token"], tokens["engine_admin_token"]) as admin:
        while True:
            alive(f"step {step} never ran on {host.name}")
            if step == 0 and not _evaluated_version_0(config):
                time.sleep(0.1)
                continue
            with contextlib.suppress(httpx.TransportError):  # a cell between two runs, a gateway restarting
                view, sessions = None, 0
                for url in gateways:  # each gateway holds the sessions of the executions pinned to it
                    with AdminClient(url, tokens["admin_token"], tokens["engine_admin_token"]) as one:
                        seen = next((e for e in one.gateway_stats().engines if e.engine_id == mine[0]), None)
                    if seen is not None:
                        view, sessions = view or seen, sessions + seen.sessions
                if view is not None and sessions > 0 and admin.engine_stats(view.url).policy_version == step:
                    break
            time.sleep(0.1)
        cut_off(host)
        cut_at = time.monotonic()
        found = None
        while True:
            alive(f"the cells of {host.name} never served again")
            if found is None and host.name in fleet.lost:
                found = time.monotonic() - cut_at
            try:
                engines = {e.engine_id: e for e in admin.gateway_stats().engines}
            except httpx.TransportError:  # the gateway restarting, or stopped by a campaign that ended
                time.sleep(0.2)
                continue
            moved = [
                c
                for c in mine
                if c in engines
                and engines[c].state == "active"
                and f"//{host.address}:" not in engines[c].url
            ]
            if len(moved) == len(mine):
                break
            time.sleep(0.2)
    return {
        "cut": host.name,
        "sessions_on_cut_cell": sessions,
        "found_lost_s": round(found if found is not None else time.monotonic() - cut_at, 2),
        "recovery_s": round(time.monotonic() - cut_at, 2),
        "moved": {r.cell_id: r.host for r in fleet.replacements},
    }


def _listening(live: list[TestHost], timeout_s: float) -> int:
    """TCP sockets still listening on the hosts' addresses once ``timeout_s`` has passed (or none is)."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = 0
        for host in live:
            if host.netns is None:
                continue
            out = subprocess.run(
                host.command(["ss", "-Htln"]), capture_output=True, text=True, check=True
            ).stdout
            count += sum(
                f" {host.address}:" in f" {line.split()[3]}" for line in out.splitlines() if line.strip()
            )
        if count == 0 or time.monotonic() > deadline:
            return count
        time.sleep(0.5)


def start_worker(host: TestHost, pool: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        host.command(worker_command(pool)),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_process(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
