"""The gateway under load: many concurrent multi-turn sessions, then every call checked in the store.

    python -m bench.load_gateway [--sessions 256] [--seconds 120] [--out bench/results/load_gateway.json]

A local stack (stack/stack.py: one rollout engine process serving the shipped warm start
data/policies/tiny-sft widened to float32, and the gateway in its own process) records into a fresh
store. ``sessions`` executions are registered through the gateway's admin API (GatewayAdmin), then
``sessions`` asyncio sessions run at once in this process, each with its own official ``openai``
AsyncOpenAI client on its execution's base_url and api_key (its own connection pool, as a harness
process has; all made before the clock starts; the client's own retries off). One pool shared by 256
sessions is not used: httpx/httpcore 1.0's pool then held requests for up to 40 s before sending them
(many requests raced for the same freed connection), which measured the client, not the gateway. A session loops turns until ``seconds`` have passed: one chat completion
(max_tokens=8, so decoding stays cheap on a CPU), then the assistant's reply and a short tool result
(or user message) are appended to its conversation, so every call sends a longer context than the one
before. A failed call (any non-200 or transport error) is counted with its message and the turn is
retried at most TURN_RETRIES more times; then the session gives up its remaining turns. At the end each
session finishes its execution as ``completed`` with a reward in [0, 1].

What is measured:

- Accounting. Each 200 carries the gateway's ``gyre.call_id``; the client keeps those per execution.
  After the final flush DuckDB reads the store (trajectory_store/db.py ``connect``):
  ``lost`` = call ids the clients saw succeed with no row in the ``calls`` view;
  ``duplicated`` = rows of the ``calls`` view beyond those the clients saw (ids no client saw
  succeed, per execution) plus rows sharing an (execution_id, call_id) in that view;
  ``raw_duplicate_rows`` (reported, not counted as duplicated) = extra rows of one (execution_id,
  call_id) in the raw Parquet parts, which the ``calls`` view folds into one by design;
  executions recorded = rows of the ``executions`` view with status completed and n_calls equal to
  what the client counted, against the number registered.
- Latency: p50 / p99 of client-observed latency of successful calls (request sent to response parsed,
  openai client included), all turns of all sessions.
- The gateway's own overhead, two ways. ``gateway_overhead_p50_s`` / ``_p99_s``: the gateway's own
  timer (/admin/stats ``gateway_overhead_ms``, engines/gateway/app.py OverheadTimer: arrival to the last
  byte sent minus the time waiting on the engine, for the most recent ``overhead_samples`` calls).
  ``client_minus_engine_p50_s`` / ``_p99_s``: per call, the client's latency minus the engine time
  the gateway recorded for that very call (calls.t_end - t_start, joined on call_id): what a harness
  pays for the gateway, the HTTP hop and the client library's own work under this load included. No
  direct calls to the engine are made: the recorded engine time is for the same request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from openai import APIError, AsyncOpenAI

from engines.admin import AdminClient, GatewayStatsReport
from engines.quantiles import quantile
from environments.gateway_admin import GatewayAdmin
from stack.stack import local_stack
from trajectory_store.db import connect
from trajectory_store.storage import Store, StoreConfig

DEFAULT_OUT = "bench/results/load_gateway.json"
POLICY = "data/policies/tiny-sft"
MAX_TOKENS = 8
TURN_RETRIES = 2
"""A failed turn is tried this many more times before its session stops making calls."""
CALL_TIMEOUT_S = 300.0
MAX_BATCH_SIZE = 32
"""Engine rows decoding together (the engine's own default; local_stack's is 8)."""
ERRORS_SHOWN = 5
SYSTEM = "You are a coding agent. Use the tools, then answer."
TASK = "Fix the failing test in the repository."
TOOL_TEXT = "exit 1: test_parser failed, expected 3 got 2"


@dataclass
class SessionLog:
    """What one session saw: the call ids of its successful calls, their latencies, its errors."""

    execution_id: str
    call_ids: list[int] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    gave_up: bool = False
    finished: bool = False


def gateway_load(sessions: int = 256, seconds: float = 120.0, root: str | None = None) -> dict[str, Any]:
    """Runs the load against a fresh local stack; ``root``: the folder for the store (default a
    temporary one, removed afterwards). Returns the figures (see the module docstring)."""
    if root is None:
        with tempfile.TemporaryDirectory(prefix="gyre-bench-load-") as tmp:
            return gateway_load(sessions, seconds, tmp)
    started = time.perf_counter()
    store = StoreConfig(data_root=os.path.join(root, "store"), campaign="load")
    with local_stack(POLICY, store, threads=1, dtype="float32", max_batch_size=MAX_BATCH_SIZE) as stack:
        stack_s = time.perf_counter() - started
        logs, stats, load_s = asyncio.run(_drive(stack.gateway_url, stack.admin_token, sessions, seconds))
    figures = _account(store, logs, stats)
    calls = figures["calls"]
    return {
        "name": f"gateway load ({sessions} sessions, {seconds:g} s)",
        "runs": 1,
        "survived": int(
            figures["lost"] == 0 and figures["duplicated"] == 0 and figures["executions_recorded"] == sessions
        ),
        "lost": figures["lost"],
        "duplicated": figures["duplicated"],
        "recovery_s": 0.0,
        "sessions": sessions,
        "seconds": seconds,
        "calls": calls,
        "calls_per_s": round(calls / load_s, 2) if load_s else 0.0,
        **figures["latency"],
        "errors": figures["errors"],
        "executions_registered": sessions,
        "executions_recorded": figures["executions_recorded"],
        "raw_duplicate_rows": figures["raw_duplicate_rows"],
        "stored_calls": figures["stored_calls"],
        "turns_per_session": figures["turns_per_session"],
        "sessions_gave_up": sum(log.gave_up for log in logs),
        "load_s": round(load_s, 2),
        "stack_start_s": round(stack_s, 2),
        "wall_s": round(time.perf_counter() - started, 2),
        "policy": POLICY,
        "max_tokens": MAX_TOKENS,
        "engine_max_batch_size": MAX_BATCH_SIZE,
        "gateway_stats": {
            key: getattr(stats, key)
            for key in (
                "calls",
                "client_errors",
                "record_errors",
                "reused_prompt_tokens",
                "tokenized_prompt_tokens",
            )
        },
    }


# the load -------------------------------------------------------------------------------------------
async def _drive(
    gateway_url: str, admin_token: str, sessions: int, seconds: float
) -> tuple[list[SessionLog], GatewayStatsReport, float]:
    """Registers, runs and finishes every session; (the logs, /admin/stats after the flush, seconds)."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)  # admin calls only
    async with httpx.AsyncClient(limits=limits, timeout=CALL_TIMEOUT_S) as http:
        admin = GatewayAdmin(gateway_url, admin_token, http)
        logs = [SessionLog(f"load-{i:04d}") for i in range(sessions)]
        registrations = await asyncio.gather(
            *(admin.register(log.execution_id, problem_id="load", harness="bench-load") for log in logs)
        )
        async with contextlib.AsyncExitStack() as clients:
            # one client per harness, each with its own connection pool, made before the clock starts
            # (making one builds an SSL context: tens of milliseconds that would stall the other sessions)
            harnesses = [
                await clients.enter_async_context(
                    AsyncOpenAI(
                        base_url=registration["base_url"],
                        api_key=registration["api_key"],
                        max_retries=0,
                        timeout=CALL_TIMEOUT_S,
                    )
                )
                for registration in registrations
            ]
            start = time.perf_counter()
            deadline = start + seconds
            await asyncio.gather(
                *(_session(admin, client, log, deadline) for client, log in zip(harnesses, logs, strict=True))
            )
            load_s = time.perf_counter() - start
    return logs, await asyncio.to_thread(_flushed_stats, gateway_url, admin_token), load_s


def _flushed_stats(gateway_url: str, admin_token: str) -> GatewayStatsReport:
    """The gateway's stats (with every overhead sample) once its recorders flushed."""
    with AdminClient(gateway_url, admin_token) as admin:
        admin.flush()
        return admin.gateway_stats(samples=True)


async def _session(admin: GatewayAdmin, client: AsyncOpenAI, log: SessionLog, deadline: float) -> None:
    """One harness: turns until the deadline, then the execution's finish."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK},
    ]
    turn = 0
    while time.perf_counter() < deadline:
        reply = await _turn(client, messages, turn, log)
        if reply is None:
            log.gave_up = True
            break
        messages.append(reply)
        tool_calls = reply.get("tool_calls") or []
        for call in tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": TOOL_TEXT})
        if not tool_calls:
            messages.append({"role": "user", "content": f"Turn {turn}: {TOOL_TEXT}. Continue."})
        turn += 1
    reward = min(1.0, len(log.call_ids) / 100)
    try:
        await admin.finish(log.execution_id, "completed", reward=reward, reward_source="final")
        log.finished = True
    except Exception as exc:  # counted: an unfinished execution is not recorded
        log.errors.append(f"finish: {exc!r}"[:300])


async def _turn(
    client: AsyncOpenAI, messages: list[dict[str, Any]], turn: int, log: SessionLog
) -> dict[str, Any] | None:
    """One turn, retried at most TURN_RETRIES times; the assistant message, or None when it failed."""
    for _ in range(1 + TURN_RETRIES):
        sent = time.perf_counter()
        try:
            completion = await client.chat.completions.create(
                model="gyre-policy",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                seed=turn,
            )
        except (APIError, httpx.HTTPError) as exc:
            log.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        latency = time.perf_counter() - sent
        gyre = (completion.model_extra or {}).get("gyre") or {}
        log.call_ids.append(int(gyre.get("call_id", -1)))
        log.latencies_s.append(latency)
        return completion.choices[0].message.model_dump(exclude_none=True)
    return None


# the accounting -------------------------------------------------------------------------------------
def _account(store: StoreConfig, logs: list[SessionLog], stats: GatewayStatsReport) -> dict[str, Any]:
    con = connect(Store(store))
    stored: dict[str, dict[int, float | None]] = {}
    for execution_id, call_id, t_start, t_end in con.execute(
        "SELECT execution_id, call_id, t_start, t_end FROM calls"
    ).fetchall():
        engine_s = t_end - t_start if t_start is not None and t_end is not None else None
        stored.setdefault(execution_id, {})[call_id] = engine_s
    view_duplicates = con.execute(
        "SELECT count(*) - count(DISTINCT (execution_id, call_id)) FROM calls"
    ).fetchone()[0]
    raw_duplicates = con.execute(
        "SELECT count(*) - count(DISTINCT (execution_id, call_id)) FROM calls_raw"
    ).fetchone()[0]
    executions = {
        execution_id: (status, n_calls)
        for execution_id, status, n_calls in con.execute(
            "SELECT execution_id, status, n_calls FROM executions"
        ).fetchall()
    }
    stored_calls = con.execute("SELECT count(*) FROM calls").fetchone()[0]
    con.close()

    lost = unseen = recorded = 0
    latencies: list[float] = []
    overheads: list[float] = []
    for log in logs:
        rows = stored.get(log.execution_id, {})
        seen = set(log.call_ids)
        lost += len(seen - rows.keys()) + (len(log.call_ids) - len(seen))  # a repeated or missing id too
        unseen += len(rows.keys() - seen)
        status, n_calls = executions.get(log.execution_id, (None, None))
        recorded += status == "completed" and n_calls == len(log.call_ids)
        latencies += log.latencies_s
        for call_id, latency in zip(log.call_ids, log.latencies_s, strict=True):
            engine_s = rows.get(call_id)
            if engine_s is not None:
                overheads.append(latency - engine_s)
    errors = [e for log in logs for e in log.errors]
    internal = sorted(v / 1e3 for v in stats.gateway_overhead_ms.recent_ms or [])
    calls = sum(len(log.call_ids) for log in logs)
    return {
        "lost": lost,
        "duplicated": unseen + view_duplicates,
        "raw_duplicate_rows": raw_duplicates,
        "executions_recorded": recorded,
        "stored_calls": stored_calls,
        "calls": calls,
        "turns_per_session": {
            "min": min((len(log.call_ids) for log in logs), default=0),
            "max": max((len(log.call_ids) for log in logs), default=0),
            "mean": round(calls / len(logs), 2) if logs else 0.0,
        },
        "latency": {
            "latency_p50_s": quantile(sorted(latencies), 0.5, digits=5),
            "latency_p99_s": quantile(sorted(latencies), 0.99, digits=5),
            "gateway_overhead_p50_s": quantile(internal, 0.5, digits=5),
            "gateway_overhead_p99_s": quantile(internal, 0.99, digits=5),
            "gateway_overhead_samples": len(internal),
            "client_minus_engine_p50_s": quantile(sorted(overheads), 0.5, digits=5),
            "client_minus_engine_p99_s": quantile(sorted(overheads), 0.99, digits=5),
        },
        "errors": {"count": len(errors), "first": errors[:ERRORS_SHOWN]},
    }


# entry point -----------------------------------------------------------------------------------------
def main(sessions: int = 256, seconds: float = 120.0, out: str = DEFAULT_OUT) -> int:
    figures = gateway_load(sessions, seconds)
    text = json.dumps(figures, indent=1)
    print(text)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as handle:
        handle.write(text + "\n")
    print(f"wrote {out}")
    return 0 if figures["survived"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--out", default=DEFAULT_OUT)
    cli = parser.parse_args()
    sys.exit(main(cli.sessions, cli.seconds, cli.out))
