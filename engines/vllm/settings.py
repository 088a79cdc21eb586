"""What the vLLM engine reads from its environment:

GYRE_VLLM_PYTHON           the Python of vLLM's environment, when the config names none (make vllm
                           and make test export it)
GYRE_ROLLOUT_ADMIN_TOKEN   the admin token when neither --admin-token nor the JSON gives one
OMP_NUM_THREADS            the thread budget its cell gave it (engines/devices), handed to vLLM
"""

from __future__ import annotations

import os

PYTHON_ENV = "GYRE_VLLM_PYTHON"
ADMIN_ENV = "GYRE_ROLLOUT_ADMIN_TOKEN"


def python_from_env() -> str | None:
    return os.environ.get(PYTHON_ENV) or None


def env_defaults() -> dict[str, str]:
    """Config defaults from the environment (the admin token)."""
    return {"admin_token": os.environ[ADMIN_ENV]} if os.environ.get(ADMIN_ENV) else {}


def thread_budget() -> int | None:
    threads = os.environ.get("OMP_NUM_THREADS")
    return int(threads) if threads else None
