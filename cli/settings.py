"""The one module of the `gyre` process that reads (and sets) environment variables.

Read here:
    GYRE_DATA_ROOT             the store of every command without --data-root (else ./gyre-data)
    GYRE_CAMPAIGN              the campaign of every command without --campaign (else default)
    GYRE_GATEWAY_URL           the gateway of gyre rollout / gyre execution without --gateway
    GYRE_GATEWAY_ADMIN_TOKEN   its admin token without --admin-token
    PREFECT_API_URL            a Prefect server to use: gyre up starts none, gyre run / deploy / worker use it

`gyre gateway` and `gyre engine` run a server in this process: their variables (admin tokens, and the
gateway's GYRE_DATA_ROOT / GYRE_CAMPAIGN) are read by engines/gateway/settings.py and
engines/rollout/settings.py, the same modules `python -m engines.gateway` and `python -m
engines.rollout.server` use. Credentials and endpoints for S3 come from the standard AWS variables,
which s3fs and botocore read themselves.

Set here: Prefect's settings, before Prefect is imported: PREFECT_HOME under the data root (a local
one), analytics off, and no API URL, which means Prefect's ephemeral mode.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from engines.options import add_config_options, build_config, given_options
from trajectory_store.storage import StoreConfig

STORE_ENV = {"data_root": "GYRE_DATA_ROOT", "campaign": "GYRE_CAMPAIGN"}
# credentials come from the standard AWS variables (s3fs reads them), never from argv
STORE_SKIP = {"aws_access_key_id", "aws_secret_access_key", "aws_region", "compression"}


def default_data_root() -> str:
    return os.environ.get("GYRE_DATA_ROOT") or StoreConfig.model_fields["data_root"].default


def default_campaign() -> str:
    return os.environ.get("GYRE_CAMPAIGN") or StoreConfig.model_fields["campaign"].default


def gateway_url() -> str | None:
    return os.environ.get("GYRE_GATEWAY_URL") or None


def gateway_admin_token() -> str | None:
    return os.environ.get("GYRE_GATEWAY_ADMIN_TOKEN") or None


def prefect_api_url() -> str | None:
    return os.environ.get("PREFECT_API_URL") or None


def use_prefect_server(url: str) -> None:
    """`gyre worker` hands the server's address to the Prefect worker it becomes."""
    os.environ["PREFECT_API_URL"] = url


def quiet_prefect() -> None:
    """`gyre run` draws a progress line: Prefect's console shows warnings and errors only (the UI has
    every log line)."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def add_store_options(
    parser: argparse.ArgumentParser, *, skip: set[str] | frozenset[str] = frozenset()
) -> None:
    """--data-root, --campaign, --s3-endpoint-url, --vocab-size: StoreConfig's fields, with their help."""
    add_config_options(parser, StoreConfig, skip=STORE_SKIP | skip, env=STORE_ENV)


def store_config(args: argparse.Namespace) -> StoreConfig:
    """The store options given over GYRE_DATA_ROOT / GYRE_CAMPAIGN over StoreConfig's defaults."""
    env = {field: os.environ[name] for field, name in STORE_ENV.items() if os.environ.get(name)}
    return build_config(StoreConfig, args, layers=[env])


def data_root_of(args: argparse.Namespace) -> str:
    """The data root a command works on (Prefect keeps its database under a local one)."""
    given = given_options(args)
    return (
        getattr(args, "data_root", None)  # gyre run's override of its config's [store]
        or given.get("data_root")
        or given.get("store", {}).get("data_root")
        or default_data_root()
    )


def configure_prefect(data_root: str) -> None:
    """Call before importing prefect (tasks/ and flows/ import it)."""
    if "://" in data_root and not data_root.startswith("file://"):
        home = Path.home() / ".gyre" / "prefect"  # the Prefect database stays on a local disk
    else:
        home = Path(data_root.removeprefix("file://")) / ".prefect"
    os.environ.setdefault("PREFECT_HOME", str(home.resolve()))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # its SQLite database lives here
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # a fresh database runs its migrations on the first start: on a busy 2-core machine that takes
    # longer than Prefect's default 20 s, and the flow would fail before it began
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
