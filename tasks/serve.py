"""Long-running servers the `gyre` CLI starts: the gateway and a rollout engine.

These are plain functions, not Prefect tasks: a server outlives any flow run (`gyre up` starts them
as processes and flows reach them over HTTP). They only translate the CLI's options into each layer's
typed config; engines/gateway/__main__.py and engines/rollout/server.py hold the logic (and the one
place each reads its admin-token environment variable).

    gyre gateway --model ./models/tiny --engine http://127.0.0.1:8100 --port 8200
    gyre engine --model ./models/tiny --port 8100 --engine-id rollout-0
"""

from __future__ import annotations

import argparse
from typing import Any


def serve_gateway(options: dict[str, Any]) -> None:
    """Runs the gateway until interrupted; ``options`` are `python -m engines.gateway`'s, by dest name."""
    from engines.gateway.__main__ import build_parser, config_from_args, serve

    args = build_parser().parse_args(["--model", options["model"]])
    for name, value in options.items():
        if value is not None:
            setattr(args, name, value)
    serve(config_from_args(args))


def serve_engine(
    model: str, host: str, port: int, engine_id: str, admin_token: str | None, device: str
) -> None:
    """Runs one rollout engine's token-id HTTP server until interrupted."""
    from engines.rollout.server import main

    argv = [
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--engine-id",
        engine_id,
        "--device",
        device,
    ]
    if admin_token:
        argv += ["--admin-token", admin_token]
    main(argv)


def gateway_options(args: argparse.Namespace) -> dict[str, Any]:
    names = ("model", "engine", "host", "port", "public_url", "admin_token", "engine_admin_token")
    names += ("data_root", "campaign", "step")
    return {name: getattr(args, name) for name in names}
