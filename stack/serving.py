"""The processes of a campaign on this machine (``[serving]``: ServingConfig), and one rollout engine
process: its command, the config its stdin gets, and the marker `gyre down` checks its command line
for, for either engine ``[serving] engine`` names.

    command, stdin, marker = engine_process(policy, serving, port, engine_token)

'gyre' is our engine (engines/rollout/server.py); 'vllm' is vLLM's own server behind our adapter
(engines/vllm/server.py), which starts vLLM in the environment the config names. Both speak the same
engine API, so nothing after this choice (the gateway, placement, the scheduler's cells) knows which
engine runs. The config travels as JSON on stdin: admin tokens never appear in argv or on disk.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import BaseModel, Field, NonNegativeFloat, NonNegativeInt, model_validator

from engines.devices import CellDevices
from engines.rollout.config import EngineConfig, EngineServerConfig
from engines.vllm.config import VllmServerConfig
from stack.devices import check_layout, engine_cell, trainer_cell


class ServingConfig(BaseModel):
    """The processes of a campaign on this machine."""

    engines: int = Field(1, ge=1, description="rollout engine processes")
    engine_threads: int = Field(1, ge=1, description="torch threads per engine")
    max_batch_size: int = Field(8, ge=1, description="sequences an engine decodes at once")
    trainer_threads: int = Field(2, ge=1, description="torch threads of the trainer process")
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32",
        description="weights and KV dtype of the engines; float32 by default, the trainer's dtype on CPU, so "
        "behaviour logprobs match what the trainer computes (a bf16 policy file is widened)",
    )
    engine: Literal["gyre", "vllm"] = Field(
        "gyre",
        description="the rollout engine: 'gyre' (ours, engines/rollout) or 'vllm' (vLLM's own server in its own "
        "environment behind a small adapter, engines/vllm; make vllm installs it)",
    )
    vllm_python: str | None = Field(
        None,
        description="engine 'vllm': the Python of vLLM's environment; None = $GYRE_VLLM_PYTHON, else "
        ".venv-vllm/bin/python under the working directory",
    )
    vllm_kv_cache_gib: float = Field(
        1.0, gt=0, description="engine 'vllm': KV cache memory per engine on CPU (VLLM_CPU_KVCACHE_SPACE)"
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="engine 'vllm': more arguments for vLLM's server, passed as they are",
    )
    devices: list[list[NonNegativeInt]] = Field(
        default_factory=list,
        description="the GPUs of each cell, one list per engine: cell i hosts engine-i (and, under the "
        "scheduler, its trainer replica; cell 0 is the core), e.g. [[0], [1], [2, 3]]. Each of its processes "
        "gets CUDA_VISIBLE_DEVICES = its cell's GPUs and uses cuda:0 inside. A GPU belongs to one cell; "
        "without engines, engines = the number of cells. [] = no GPUs named: every process sees what "
        "gyre was started with",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs one model replica spans (vLLM's tensor_parallel_size); it must divide every "
        "cell's GPU count. The gyre engine runs on one GPU: its cell's first",
    )
    cores: list[list[NonNegativeInt]] = Field(
        default_factory=list,
        description="on CPU, optionally: the cores each cell's processes are pinned to (os.sched_setaffinity), "
        "one list per engine like devices, e.g. [[0, 1], [2, 3]]; their thread budgets stay engine_threads "
        "and trainer_threads. [] = not pinned",
    )
    partition: Literal["none", "cgroup"] = Field(
        "none",
        description="'cgroup': each cell owns its CPU share as it owns its GPUs: a CPU cgroup per cell whose "
        "quota is the cell's cores (its cores entry, else the machine's cores over the cells), holding the "
        "cell's engine, trainer replica and (cell 0) core trainer, so an idle cell's share is lost and a cell "
        "that switches role takes its share along (engines/devices/cpu_quota.py; needs root and a writable "
        "cgroup cpu controller, else one warning and the cells share the cores). 'none': cells share the cores",
    )
    host_cores: NonNegativeFloat = Field(
        0.0,
        description="with partition = 'cgroup': cores kept for the processes of no cell (the gateway, the "
        "dispatcher, every harness and the commands it runs, the flow itself), as on a GPU host they use the "
        "host's CPUs and not the cells' devices. They get a cgroup with this quota and the cells share the rest "
        "of the cores. 0 = those processes are not confined: they take what the cells leave",
    )
    trainer_devices: list[NonNegativeInt] | None = Field(
        None, description="the trainer process's GPUs; None = the core cell's (devices[0])"
    )
    trainer_cores: list[NonNegativeInt] | None = Field(
        None, description="the cores the trainer process is pinned to; None = the core cell's (cores[0])"
    )

    @model_validator(mode="before")
    @classmethod
    def _engines_from_cells(cls, data: Any) -> Any:
        """Naming cells without ``engines`` makes one engine per cell."""
        if isinstance(data, dict) and "engines" not in data:
            cells = data.get("devices") or data.get("cores")
            if isinstance(cells, list) and cells:
                data = {**data, "engines": len(cells)}
        return data

    @model_validator(mode="after")
    def _placeable(self) -> ServingConfig:
        check_layout(self)
        return self

    def engine_cell(self, index: int) -> CellDevices:
        """What engine-``index`` and its cell's replica get (stack/devices.py)."""
        return engine_cell(self, index)

    def trainer_cell(self) -> CellDevices:
        """What the trainer process gets (stack/devices.py)."""
        return trainer_cell(self)


ENGINE_MARKERS = {"gyre": "engines.rollout.server", "vllm": "engines.vllm"}
"""What an engine's command line holds, by kind (`gyre down` checks it; `up` tells the kinds apart)."""


def engine_process(
    policy: str,
    serving: ServingConfig,
    port: int,
    admin_token: str,
    *,
    host: str = "127.0.0.1",
    engine_id: str | None = None,
) -> tuple[list[str], str, str]:
    """(command, its stdin, marker) of an engine on ``host:port`` serving ``policy``; ``engine_id``: its
    name (None: rollout-<port> or vllm-<port>)."""
    if serving.engine == "vllm":
        config = VllmServerConfig(
            model=policy,
            host=host,
            port=port,
            engine_id=engine_id,
            admin_token=admin_token,
            python=serving.vllm_python,
            dtype=serving.engine_dtype,
            kv_cache_gib=serving.vllm_kv_cache_gib,
            tensor_parallel_size=serving.tensor_parallel_size,
            extra_args=serving.vllm_args,
        )
        config.vllm_python()  # no vLLM environment: say so here, before any process starts
        return (
            [sys.executable, "-m", "engines.vllm", "--config", "-"],
            config.model_dump_json(),
            ENGINE_MARKERS["vllm"],
        )
    engine = EngineServerConfig(
        model=policy,
        host=host,
        port=port,
        engine_id=engine_id,  # None: rollout-<its port>
        admin_token=admin_token,
        engine=EngineConfig(max_batch_size=serving.max_batch_size, dtype=serving.engine_dtype),
    )
    command = [sys.executable, "-m", "engines.rollout.server", "--config", "-"]
    return command, engine.model_dump_json(), ENGINE_MARKERS["gyre"]
