"""CoreTrainer: the core cell. Authoritative weights and optimizer state live in a DeepSpeed engine.

Gradients of a step are computed outside the engine (by GradWorkers: the core's own and the
satellites'), summed with one reduction, and injected into DeepSpeed with a surrogate loss
``sum(p * g)``, whose gradient with respect to p is exactly g. DeepSpeed then clips and steps as it
always does (ZeRO stages 0-2). Every step makes a new policy version; ``publish`` writes it as
safetensors to object storage and to a fast in-host path for engines and satellites on this host.

One copy of the weights. The core's GradWorker computes on the engine's own module (its gradients
come from ``torch.autograd.grad``, so DeepSpeed's gradient hooks, which fire only when a gradient
accumulates into ``.grad``, never see them); in float32 at ZeRO stage 0 (the default) AdamW steps
those same parameters, so the trainer holds one full-precision copy of the policy. In bfloat16 the
module is bf16 and DeepSpeed keeps the one fp32 master. ``python -m bench.train_memory`` counts them.

DeepSpeed on CPU JIT-compiles its deepspeed_shm_comm op with g++ on first initialize (tens of
seconds, and it fails without a compiler); the core never uses that op, so it is switched off.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import fsspec
import torch

from engines.model.storage import TOKENIZER_FILE_PATTERNS, fetch_folder, is_model_file
from engines.model.weights import save_weights
from engines.net import free_port
from engines.train.config import TrainerConfig
from engines.train.worker import GradWorker

_DISTRIBUTED_READY = False


def _deepspeed():
    import deepspeed

    # the CPU accelerator would JIT-build this op with g++ at initialize; the core never needs it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def ensure_distributed() -> None:
    """DeepSpeed needs a default process group: the core cell is its own one-process world."""
    global _DISTRIBUTED_READY
    if _DISTRIBUTED_READY or torch.distributed.is_initialized():
        _DISTRIBUTED_READY = True
        return
    deepspeed = _deepspeed()
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's engine reads these variables itself (set by its launcher or torchrun otherwise)
    for name, value in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    # the engine lives on DeepSpeed's accelerator: on CUDA its ZeRO collectives take GPU tensors, which
    # NCCL reduces in place (gloo would stage them through the host, and lacks some ops on GPU tensors);
    # on the CPU accelerator gloo (its own default, oneCCL, is not installed). Satellites reduce over
    # their own gloo groups (elastic.py), whatever this is.
    backend = "nccl" if get_accelerator().device_name() == "cuda" else "gloo"
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        verbose=False,
    )
    _DISTRIBUTED_READY = True


@dataclass(frozen=True)
class PublishedPolicy:
    version: int
    uri: str  # object storage: <root>/policy/v<version>/model.safetensors
    local_path: str  # fast in-host path (shared memory when the host has /dev/shm)


def default_fast_dir() -> str:
    base = (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )
    return os.path.join(base, f"gyre-{os.getuid()}")


class CoreTrainer:
    """The core cell's trainer. Attributes, as a table of contents:

    engine     the DeepSpeed engine (weights + optimizer)
    worker     the core's own GradWorker, on the engine's module (no copy of the weights)
    version    policy version of the current weights (one per step)
    step       steps taken (a step is one optimizer update, or several: TrainerConfig.mini_batches/epochs)
    """

    def __init__(self, model: torch.nn.Module, config: TrainerConfig, *, version: int = 0, step: int = 0):
        ensure_distributed()
        self.config = config
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": config.max_grad_norm,
            "zero_optimization": {"stage": config.zero_stage},
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": config.lr,
                    "betas": list(config.betas),
                    "eps": config.eps,
                    "weight_decay": config.weight_decay,
                    "torch_adam": True,
                },
            },
            "bf16": {"enabled": config.dtype == "bfloat16"},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = _deepspeed().initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
        )
        self.params = [p for p in self.engine.module.parameters() if p.requires_grad]
        self.worker = GradWorker(self.engine.module, config.loss)
        self.version = version
        self.step = step
        self.last_grad_norm = 0.0
        self.last_grad: torch.Tensor | None = None

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in self.engine.module.state_dict().items()}

    def sync_worker(self) -> None:
        """The worker computes on the engine's module, so it always has the current weights: only
        the version it reports moves."""
        self.worker.version = self.version

    def apply(self, grad: torch.Tensor, *, new_version: bool = True) -> float:
        """One optimizer update with the given flat gradient sum; returns the pre-clip gradient norm.
        ``new_version`` False: an update inside a step of several (the step's last one makes the
        version)."""
        expected = sum(p.numel() for p in self.params)
        if grad.numel() != expected:
            raise ValueError(f"gradient has {grad.numel()} values, the model has {expected} parameters")
        surrogate = torch.zeros((), dtype=torch.float32)
        offset = 0
        for param in self.params:
            n = param.numel()
            piece = grad[offset : offset + n].view_as(param).to(param.device, param.dtype)
            surrogate = surrogate + (param * piece).sum()
            offset += n
        self.engine.backward(surrogate)
        self.last_grad = grad  # kept for inspection (benchmarks compare it across setups)
        self.last_grad_norm = float(torch.linalg.vector_norm(grad.double()))
        self.engine.step()
        if new_version:
            self.step += 1
            self.version += 1
        return self.last_grad_norm

    # -- checkpoints and publishing -----------------------------------------------------------
    def save_checkpoint(self, url: str) -> str:
        """HF-format weights + DeepSpeed optimizer state + trainer state; ``url`` may be remote."""
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "checkpoint"
            self.engine.save_checkpoint(str(local / "deepspeed"), tag=f"step{self.step}")
            self.engine.module.save_pretrained(str(local / "hf"), safe_serialization=True)
            (local / "trainer_state.json").write_text(
                json.dumps({"step": self.step, "version": self.version, "config": self.config.model_dump()})
            )
            fs, root = fsspec.core.url_to_fs(url)
            fs.put(str(local), root.rstrip("/"), recursive=True)
        return url

    def load_checkpoint(self, url: str) -> None:
        fs, root = fsspec.core.url_to_fs(url)
        with tempfile.TemporaryDirectory() as tmp:
            fs.get(root.rstrip("/") + "/", tmp + "/", recursive=True)
            local = Path(tmp)
            state = json.loads((local / "trainer_state.json").read_text())
            self.engine.load_checkpoint(str(local / "deepspeed"), tag=f"step{state['step']}")
        self.step, self.version = state["step"], state["version"]

    def publish(
        self, store_root: str, fast_dir: str | None = None, *, tokenizer_from: str | None = None
    ) -> PublishedPolicy:
        """Writes the current weights as policy version ``self.version`` (idempotent per version).

        With ``tokenizer_from`` (a model folder or URL, e.g. the campaign's starting policy), its
        tokenizer files are copied beside the weights, so the version folder serves on its own
        (``gyre model eval --model <campaign>/policy/v<n>``); config.json is written last either way."""
        fast_dir = fast_dir or default_fast_dir()
        local = os.path.join(fast_dir, f"policy-v{self.version}.safetensors")
        save_weights(self.engine.module.state_dict(), local, self.version)
        fs, root = fsspec.core.url_to_fs(store_root)
        remote = f"{root.rstrip('/')}/policy/v{self.version}"
        fs.makedirs(remote, exist_ok=True)
        fs.put_file(local, f"{remote}/model.safetensors")
        if tokenizer_from is not None:
            source = fetch_folder(tokenizer_from, patterns=TOKENIZER_FILE_PATTERNS)
            for path in sorted(source.iterdir()):
                if path.name != "config.json" and is_model_file(path.name, TOKENIZER_FILE_PATTERNS):
                    fs.put_file(str(path), f"{remote}/{path.name}")
        fs.pipe_file(f"{remote}/config.json", self.engine.module.config.to_json_string().encode())
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        uri = (
            f"{remote}/model.safetensors"
            if protocol in ("file", "local")
            else f"{protocol}://{remote}/model.safetensors"
        )
        return PublishedPolicy(self.version, uri, local)
