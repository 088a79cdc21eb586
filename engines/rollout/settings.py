"""How the engine server process gets its config (EngineServerConfig): command-line options generated
from the config class (engines/options.py), a whole config as JSON (--config FILE, or '-' for stdin,
which is how stack/stack.py starts engines), and the one environment variable it reads:

    GYRE_ROLLOUT_ADMIN_TOKEN   the admin token when neither --admin-token nor the JSON gives one

`python -m engines.rollout.server` and `gyre engine` build the same parser here, so they show the same
options with the same defaults and help.
"""

from __future__ import annotations

import argparse
import os

from engines.options import add_config_file_option, add_config_options, build_config
from engines.rollout.config import EngineServerConfig

ENV = {"admin_token": "GYRE_ROLLOUT_ADMIN_TOKEN"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_file_option(parser, EngineServerConfig)
    add_config_options(
        parser,
        EngineServerConfig,
        skip={"engine.engine_id"},  # the server's own --engine-id names the engine
        sections={"engine": "engine (EngineConfig: batching, KV budget, dtype, device)"},
        env=ENV,
    )


def env_defaults() -> dict[str, str]:
    return {field: os.environ[name] for field, name in ENV.items() if os.environ.get(name)}


def config_from_args(args: argparse.Namespace) -> EngineServerConfig:
    """The options given over the --config JSON over the environment over the class's defaults."""
    return build_config(EngineServerConfig, args, layers=[env_defaults()])
