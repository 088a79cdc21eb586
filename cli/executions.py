"""`gyre execution register|finish`: the gateway's admin API for an external harness, so a user need not
speak it by hand. The lifecycle of one execution:

    eval "$(gyre execution register --problem-id fix-parser --format env)"
        # sets GYRE_EXECUTION_ID, OPENAI_BASE_URL and OPENAI_API_KEY (the text format prints them)
    python my_agent.py            # any OpenAI-compatible client: every call is recorded token-exactly
    gyre execution finish "$GYRE_EXECUTION_ID" --status completed --reward 1.0

Finishing records the execution next to its calls and flushes the gateway's recorders, so `gyre sql`
sees all of its calls at once; until then calls reach the store on the gateway's periodic flush (every
30 s by default, GatewayConfig.flush_interval_s). An execution never finished is never recorded as one.
Both commands take --gateway URL and --admin-token (defaults: $GYRE_GATEWAY_URL,
$GYRE_GATEWAY_ADMIN_TOKEN); `gyre rollout` uses the same client (environments/dispatch.py GatewayAdmin).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cli import settings
from trajectory_store.schema import REWARD_SOURCES, STATUSES

T = TypeVar("T")


def add_gateway_options(parser: argparse.ArgumentParser, *, alternative: str = "") -> None:
    parser.add_argument(
        "--gateway", default=None, help=f"a running gateway's URL (default: $GYRE_GATEWAY_URL){alternative}"
    )
    parser.add_argument(
        "--admin-token", default=None, help="the gateway's admin token (default: $GYRE_GATEWAY_ADMIN_TOKEN)"
    )


def gateway_of(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(URL, admin token) from the options or the environment; either may be None."""
    return args.gateway or settings.gateway_url(), args.admin_token or settings.gateway_admin_token()


def admin_token_for(url: str, token: str | None) -> str:
    if not token:
        raise ValueError(
            f"the gateway at {url} needs its admin token: --admin-token or $GYRE_GATEWAY_ADMIN_TOKEN"
        )
    return token


def call_gateway(url: str, token: str, action: Callable[[Any], Awaitable[T]]) -> T:
    """Runs ``action(GatewayAdmin)``; a refusal or an unreachable gateway becomes one ValueError line."""
    import httpx

    from environments.gateway_admin import GatewayAdmin, GatewayAdminError

    async def run() -> T:
        async with httpx.AsyncClient() as client:
            return await action(GatewayAdmin(url, token, client))

    try:
        return asyncio.run(run())
    except GatewayAdminError as exc:
        raise ValueError(str(exc)) from None
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach the gateway at {url}: {exc}") from None


def recorded_line(stats: dict[str, Any], step: int | None) -> str:
    """Where the gateway records: 'recorded to <data_root> (campaign <name>, step <n>)'."""
    store = stats.get("store") or {}
    where = store.get("data_root", "the gateway's data root")
    return f"recorded to {where} (campaign {store.get('campaign', '?')}, step {step})"


def add_execution_parser(commands) -> None:
    execution = commands.add_parser(
        "execution", help="register and finish one execution on a gateway (an external harness's lifecycle)"
    )
    sub = execution.add_subparsers(dest="execution_command", required=True, metavar="SUBCOMMAND")
    register = sub.add_parser(
        "register", help="register an execution: prints its base_url and api_key for any OpenAI client"
    )
    register.add_argument(
        "--execution-id", default=None, help="the execution's id (default: x-<random>, never one used before)"
    )
    register.add_argument("--problem-id", default=None, help="the problem it works on (recorded)")
    register.add_argument("--group-id", default=None, help="its group (executions compared in GRPO)")
    register.add_argument("--step", type=int, default=None, help="its step (default: the gateway's --step)")
    register.add_argument("--harness", default="external", help="recorded in executions.harness")
    register.add_argument(
        "--campaign",
        default=None,
        help="record it in this campaign of the gateway's data root (default: the gateway's campaign)",
    )
    register.add_argument(
        "--format",
        choices=["text", "env", "json"],
        default="text",
        help="env: shell exports of GYRE_EXECUTION_ID, OPENAI_BASE_URL, OPENAI_API_KEY (for eval)",
    )
    add_gateway_options(register)
    finish = sub.add_parser(
        "finish", help="finish an execution: the gateway records it next to its calls and flushes them"
    )
    finish.add_argument("execution_id", help="the id register printed")
    finish.add_argument("--status", choices=STATUSES, required=True, help="how it ended")
    finish.add_argument(
        "--reward", type=float, default=None, help="in [0, 1]; leave it out when there is none (eval_failed)"
    )
    finish.add_argument(
        "--reward-source", choices=REWARD_SOURCES, default=None, help="where the reward came from"
    )
    finish.add_argument("--snapshot-uri", default=None, help="the workspace snapshot it was graded from")
    add_gateway_options(finish)


def run_execution_command(args: argparse.Namespace) -> int:
    url, token = gateway_of(args)
    if not url:
        raise ValueError("give the gateway: --gateway URL or $GYRE_GATEWAY_URL")
    token = admin_token_for(url, token)
    if args.execution_command == "register":
        return _register(args, url, token)
    return _finish(args, url, token)


def _register(args: argparse.Namespace, url: str, token: str) -> int:
    execution_id = args.execution_id or f"x-{secrets.token_hex(6)}"

    async def register(admin) -> dict[str, Any]:
        return await admin.register(
            execution_id,
            problem_id=args.problem_id,
            group_id=args.group_id,
            step=args.step,
            harness=args.harness,
            campaign=args.campaign,
        )

    registration = call_gateway(url, token, register)
    if args.format == "json":
        print(json.dumps(registration, indent=1))
    elif args.format == "env":
        print(f"export GYRE_EXECUTION_ID={execution_id}")
        print(f"export OPENAI_BASE_URL={registration['base_url']}")
        print(f"export OPENAI_API_KEY={registration['api_key']}")
    else:
        again = "" if registration.get("created", True) else " (it was already live: the same key)"
        print(f"registered execution {execution_id} at step {registration['step']} on {url}{again}")
        print(f"base_url  {registration['base_url']}")
        print(f"api_key   {registration['api_key']}")
        print(f"then:     gyre execution finish {execution_id} --status completed --reward R")
    return 0


def _finish(args: argparse.Namespace, url: str, token: str) -> int:
    async def finish(admin) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        execution = await admin.execution(args.execution_id)
        finished = await admin.finish(
            args.execution_id,
            args.status,
            reward=args.reward,
            reward_source=args.reward_source,
            snapshot_uri=args.snapshot_uri,
        )
        return execution, finished, await admin.stats()

    execution, finished, stats = call_gateway(url, token, finish)
    reward = "no reward" if args.reward is None else f"reward {args.reward:g}"
    print(
        f"finished execution {args.execution_id} ({args.status}, {reward}): {finished['calls']} calls; "
        + recorded_line(stats, execution.get("step"))
    )
    return 0
