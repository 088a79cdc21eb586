"""Run the gateway: python -m engines.gateway --model DIR --engine URL [--engine URL ...] [options].

Every option is a GatewayConfig field (its section's: limits, store), generated with its default and
help by settings.py, which `gyre gateway` uses too; --config FILE (or '-' for stdin) takes the whole
config as JSON, as stack/stack.py passes it. settings.py also names the environment variables read.

    serve(GatewayConfig(model=..., engines=[EngineSpec(url=...)]))   # the same, from a typed config
"""

from __future__ import annotations

import argparse
import logging
import sys

from engines.gateway import settings
from engines.gateway.config import GatewayConfig
from engines.net import serve_http
from engines.options import parse_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engines.gateway", description=__doc__.split("\n")[0])
    settings.add_arguments(parser)
    return parser


def serve(config: GatewayConfig) -> None:
    """Serves until interrupted: the start banner and (with config.access_log) the access log on stderr."""
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
    serve_http(app, config.host, config.port)


def main(argv: list[str] | None = None) -> None:
    serve(parse_config(build_parser(), settings.config_from_args, argv))


if __name__ == "__main__":
    main()
