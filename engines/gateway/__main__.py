"""Run the gateway: python -m engines.gateway --model DIR --engine URL [--engine URL ...] [options].

The admin token comes from --admin-token, else $GYRE_GATEWAY_ADMIN_TOKEN, else a random one printed
once on stderr; the engines' admin token (for KV migration) from --engine-admin-token, else
$GYRE_ROLLOUT_ADMIN_TOKEN. These are the only environment reads of the gateway.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys

from engines.gateway.config import EngineSpec, GatewayConfig, LimitsConfig
from trajectory_store.storage import StoreConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engines.gateway", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="folder of the policy's tokenizer (with its chat template)"
    )
    parser.add_argument(
        "--engine", action="append", default=[], metavar="URL", help="a rollout engine (repeat)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument(
        "--public-url", default=None, help="base of the base_urls handed out (default http://host:port)"
    )
    parser.add_argument("--served-model-name", default="gyre-policy")
    parser.add_argument("--admin-token", default=None, help="default: $GYRE_GATEWAY_ADMIN_TOKEN, else random")
    parser.add_argument("--engine-admin-token", default=None, help="default: $GYRE_ROLLOUT_ADMIN_TOKEN")
    parser.add_argument("--data-root", default="./gyre-data", help="fsspec URL of the trajectory store")
    parser.add_argument("--campaign", default="default")
    parser.add_argument("--step", type=int, default=0, help="step of executions registered without one")
    parser.add_argument(
        "--access-log", action="store_true", help="one line per HTTP request on stderr (off by default)"
    )
    limits = parser.add_argument_group("limits (LimitsConfig: what one request or execution may ask for)")
    for name, field in LimitsConfig.model_fields.items():  # one option per field: --max-prompt-chars ...
        limits.add_argument(
            "--" + name.replace("_", "-"), type=int, default=field.default, help=field.description
        )


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    admin_token = args.admin_token or os.environ.get("GYRE_GATEWAY_ADMIN_TOKEN")
    if not admin_token:
        admin_token = secrets.token_urlsafe(24)
        print(f"gateway admin token (random, this run only): {admin_token}", file=sys.stderr)
    return GatewayConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        public_url=args.public_url,
        served_model_name=args.served_model_name,
        admin_token=admin_token,
        engines=[EngineSpec(url=url) for url in args.engine],
        engine_admin_token=args.engine_admin_token or os.environ.get("GYRE_ROLLOUT_ADMIN_TOKEN"),
        limits=LimitsConfig(**{name: getattr(args, name) for name in LimitsConfig.model_fields}),
        store=StoreConfig(data_root=args.data_root, campaign=args.campaign),
        step=args.step,
        access_log=args.access_log,
    )


def serve(config: GatewayConfig) -> None:
    import uvicorn

    from engines.gateway.app import create_app
    from engines.gateway.service import Gateway

    if config.access_log:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        access = logging.getLogger("engines.gateway.access")
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False
    app = create_app(Gateway(config), banner=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")


def main(argv: list[str] | None = None) -> None:
    serve(config_from_args(build_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
