"""Long-running servers the `gyre` CLI starts in its own process: the gateway and a rollout engine.

These are plain functions, not Prefect tasks: a server outlives any flow run (flows reach them over
HTTP). Each takes its layer's typed config whole (built from the command line by
engines/gateway/settings.py and engines/rollout/settings.py, which `python -m engines.gateway` and
`python -m engines.rollout.server` use too); stack/stack.py starts the same servers as processes.

    gyre gateway --model ./models/tiny --engine http://127.0.0.1:8100 --port 8200
    gyre engine --model ./models/tiny --port 8100
"""

from __future__ import annotations

from engines.gateway.config import GatewayConfig
from engines.rollout.config import EngineServerConfig


def serve_gateway(config: GatewayConfig) -> None:
    """Runs the gateway until interrupted."""
    from engines.gateway.__main__ import serve

    serve(config)


def serve_engine(config: EngineServerConfig) -> None:
    """Runs one rollout engine's token-id HTTP server until interrupted."""
    from engines.rollout.server import serve

    serve(config)
