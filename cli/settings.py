"""The one place that reads and sets environment variables.

GYRE_DATA_ROOT and GYRE_CAMPAIGN give defaults to every command. Prefect is configured here before
it is imported: PREFECT_HOME under the data root (a local one), analytics off, and no API URL
means Prefect's ephemeral mode. Credentials and endpoints for S3 come from the standard AWS
variables, which s3fs and botocore read themselves.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_data_root() -> str:
    return os.environ.get("GYRE_DATA_ROOT", "./gyre-data")


def default_campaign() -> str:
    return os.environ.get("GYRE_CAMPAIGN", "default")


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
