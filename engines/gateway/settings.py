"""How the gateway process gets its config (GatewayConfig): command-line options generated from the
config class (engines/options.py), a whole config as JSON (--config FILE, or '-' for stdin, which is
how stack/stack.py starts a gateway), and the environment variables it reads (only here):

    GYRE_GATEWAY_ADMIN_TOKEN   the admin token when neither --admin-token nor the JSON gives one
                               (else a random one, printed once on stderr)
    GYRE_ROLLOUT_ADMIN_TOKEN   the engines' admin token (KV migration), likewise
    GYRE_DATA_ROOT             the trajectory store, likewise (else ./gyre-data)
    GYRE_CAMPAIGN              the campaign, likewise (else default)

`python -m engines.gateway` and `gyre gateway` build the same parser here, so they show the same
options with the same defaults and help.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import Any

from engines.gateway.config import GatewayConfig
from engines.options import add_config_file_option, add_config_options, build_config, merge

ENV = {
    "admin_token": "GYRE_GATEWAY_ADMIN_TOKEN",
    "engine_admin_token": "GYRE_ROLLOUT_ADMIN_TOKEN",
    "store.data_root": "GYRE_DATA_ROOT",
    "store.campaign": "GYRE_CAMPAIGN",
}
# credentials come from the standard AWS variables (s3fs reads them) or the JSON, never from argv
STORE_SKIP = {"store.aws_access_key_id", "store.aws_secret_access_key", "store.aws_region"}
STORE_SKIP |= {"store.vocab_size", "store.compression"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_file_option(parser, GatewayConfig)
    parser.add_argument(
        "--engine",
        dest="config.engines",
        action="append",
        type=lambda url: {"url": url},  # an EngineSpec
        metavar="URL",
        default=argparse.SUPPRESS,
        help="a rollout engine's base URL (repeat for more; default: none, add them later with "
        "POST /admin/engines); given here, they replace the JSON's engines",
    )
    add_config_options(
        parser,
        GatewayConfig,
        skip={"engines", *STORE_SKIP},
        sections={
            "limits": "limits (LimitsConfig: what one request or execution may ask for)",
            "store": "store (StoreConfig: where calls and executions are recorded)",
        },
        env=ENV,
        default_text={"admin_token": "a random one, printed once on stderr"},
    )


def env_defaults() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field, name in ENV.items():
        if os.environ.get(name):
            *section, key = field.split(".")
            values = merge(
                values, {section[0]: {key: os.environ[name]}} if section else {key: os.environ[name]}
            )
    return values


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The options given over the --config JSON over the environment over the class's defaults; with
    no admin token anywhere, a random one (printed once on stderr)."""
    config = build_config(GatewayConfig, args, layers=[env_defaults()])
    if config.admin_token is None:
        config.admin_token = secrets.token_urlsafe(24)
        print(f"gateway admin token (random, this run only): {config.admin_token}", file=sys.stderr)
    return config
