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

A core of several ranks (``world``, a CoreWorld: [cluster] core_hosts puts ranks on other hosts) is
one DeepSpeed world over torch.distributed (gloo on CPU, NCCL on GPUs). Rank 0 is this trainer: it
opens each elastic step and invites the other ranks to it (``invite``): each (engines/train/peer.py,
``follow``) takes micro-batches of the step as a satellite does, with the weights it already holds,
so every rank computes; rank 0 reduces the step's gradient sum (engines/train/elastic.py) and
broadcasts it with each command (``apply``, a checkpoint, the end of the step); the other ranks
inject the same sum, so DeepSpeed's data-parallel mean is that sum, and every rank steps its share of the optimizer
state (ZeRO 1-2) and gathers the updated weights. The update equals the one-rank core's (the clip's
norm is summed over the shares, so it may differ in the last bits). Checkpoints are collective: every
rank writes its optimizer share to the same checkpoint folder in object storage, and restores it.

DeepSpeed on CPU JIT-compiles its deepspeed_shm_comm op with g++ on first initialize (tens of
seconds, and it fails without a compiler); the core never uses that op, so it is switched off.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import fsspec
import torch

from engines.model.storage import TOKENIZER_FILE_PATTERNS, fetch_folder, is_model_file
from engines.model.weights import save_weights
from engines.net import free_port
from engines.train.config import CoreWorld, TrainerConfig
from engines.train.worker import GradWorker

_DISTRIBUTED_READY = False


def _deepspeed():
    import deepspeed

    # the CPU accelerator would JIT-build this op with g++ at initialize; the core never needs it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def ensure_distributed(world: CoreWorld | None = None) -> None:
    """DeepSpeed needs a default process group: the core cell's own world, of one process unless
    ``world`` names several ranks (the process then joins it: rank 0 opens the rendezvous)."""
    global _DISTRIBUTED_READY
    size = 1 if world is None else world.size
    if _DISTRIBUTED_READY or torch.distributed.is_initialized():
        if torch.distributed.get_world_size() != size:
            raise RuntimeError(
                f"this process is already in a DeepSpeed world of {torch.distributed.get_world_size()} "
                f"ranks; a core of {size} needs a process of its own"
            )
        _DISTRIBUTED_READY = True
        return
    deepspeed = _deepspeed()
    from deepspeed.accelerator import get_accelerator

    rank = 0 if world is None else world.rank
    # DeepSpeed's engine reads these variables itself (set by its launcher or torchrun otherwise); every
    # rank is the only one of the core on its host, or the host's cores are split by control groups
    for name, value in (("LOCAL_RANK", "0"), ("RANK", str(rank)), ("WORLD_SIZE", str(size))):
        os.environ[name] = value
    # the engine lives on DeepSpeed's accelerator: on CUDA its ZeRO collectives take GPU tensors, which
    # NCCL reduces in place (gloo would stage them through the host, and lacks some ops on GPU tensors);
    # on the CPU accelerator gloo (its own default, oneCCL, is not installed). Satellites reduce over
    # their own gloo groups (elastic.py), whatever this is.
    backend = "nccl" if get_accelerator().device_name() == "cuda" else "gloo"
    if world is None:
        init_method, timeout = f"tcp://127.0.0.1:{free_port()}", timedelta(minutes=10)
    else:
        # gloo binds to the interface of the host's hostname unless told: name the one holding this
        # rank's address (a host's hostname may resolve to loopback, which other hosts cannot reach)
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(world.local_address or world.address)
        init_method, timeout = f"tcp://{world.address}:{world.port}", timedelta(seconds=world.timeout_s)
    world_at = {"init_method": init_method, "rank": rank, "world_size": size, "timeout": timeout}
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, **world_at)
    _DISTRIBUTED_READY = True


def _leave_world() -> None:
    """Ends this process's part in a core of several: its process group is destroyed now, not by the
    interpreter's exit (where gloo's threads may abort the process)."""
    global _DISTRIBUTED_READY
    torch.distributed.destroy_process_group()
    _DISTRIBUTED_READY = False


def interface_of(address: str) -> str:
    """The name of this host's network interface that holds ``address``."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            return name
    raise ValueError(f"no network interface of this host holds {address} (a core rank binds to its address)")


# a command from rank 0 to the others: [what, size of what follows, step, version]
_APPLY, _NOT_A_VERSION, _SAVE, _STOP, _JOIN = 1, 2, 3, 4, 5


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

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainerConfig,
        *,
        version: int = 0,
        step: int = 0,
        world: CoreWorld | None = None,
    ):
        ensure_distributed(world)
        self.config = config
        self.world = world
        self.rank = 0 if world is None else world.rank
        self.ranks = 1 if world is None else world.size
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
        if self.world is not None:  # the other ranks make the same update with the same sum
            self._command(_APPLY if new_version else _NOT_A_VERSION, grad.numel())
            torch.distributed.broadcast(grad.detach().to(torch.float64).contiguous(), 0)
        return self._apply(grad, new_version)

    def _apply(self, grad: torch.Tensor, new_version: bool) -> float:
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

    # -- the other ranks of a core of several -------------------------------------------------
    def _command(self, what: int, size: int = 0) -> None:
        header = torch.tensor([what, size, self.step, self.version], dtype=torch.int64)
        torch.distributed.broadcast(header, 0)

    def invite(self, address: tuple[str, int, int]) -> None:
        """Rank 0 of a core of several: the other ranks join the elastic step at ``address`` (host,
        port, step) and compute micro-batches of it with the weights they hold (``follow``'s ``join``)."""
        if self.world is None or self.rank != 0:
            raise RuntimeError("only rank 0 of a core of several invites its ranks to a step")
        encoded = torch.tensor(list(":".join(str(part) for part in address).encode()), dtype=torch.uint8)
        self._command(_JOIN, encoded.numel())
        torch.distributed.broadcast(encoded, 0)

    def follow(self, join: Callable[[str, int, int], None] | None = None) -> int:
        """A rank above 0: makes every update, checkpoint and version rank 0 sends, until it ends the
        step (or a collective times out: rank 0 died); ``join(host, port, step)`` takes its share of
        each elastic step rank 0 invites it to (engines/train/peer.py: as a satellite that holds the
        step's weights already). Returns the updates made."""
        if self.rank == 0:
            raise RuntimeError("rank 0 leads; only the other ranks of a core follow")
        updates = 0
        while True:
            header = torch.zeros(4, dtype=torch.int64)
            torch.distributed.broadcast(header, 0)
            what, size, self.step, self.version = (int(v) for v in header)
            if what == _JOIN:
                raw = torch.empty(size, dtype=torch.uint8)
                torch.distributed.broadcast(raw, 0)
                host, port, step = bytes(raw.tolist()).decode().rsplit(":", 2)
                self.sync_worker()
                if join is not None:
                    join(host, int(port), int(step))
            elif what in (_APPLY, _NOT_A_VERSION):
                grad = torch.empty(size, dtype=torch.float64)
                torch.distributed.broadcast(grad, 0)
                self._apply(grad, new_version=what == _APPLY)
                updates += 1
            elif what == _SAVE:
                url = torch.empty(size, dtype=torch.uint8)
                torch.distributed.broadcast(url, 0)
                self.save_checkpoint(bytes(url.tolist()).decode())
            elif what == _STOP:
                _leave_world()
                return updates
            else:
                raise RuntimeError(f"rank 0 sent an unknown command {what}")

    def close(self) -> None:
        """Rank 0 of a core of several: the step is over, the other ranks exit."""
        if self.world is not None and self.rank == 0:
            self._command(_STOP)
            _leave_world()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (AdamW's moments, and ZeRO's float32 master share)."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        tensors = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
        masters = getattr(self.optimizer, "single_partition_of_fp32_groups", [])
        return sum(t.numel() * t.element_size() for t in [*tensors, *masters])

    # -- checkpoints and publishing -----------------------------------------------------------
    def save_checkpoint(self, url: str) -> str:
        """HF-format weights + DeepSpeed optimizer state + trainer state; ``url`` may be remote. In a
        core of several ranks every rank writes its optimizer share there (rank 0 tells them to), and
        rank 0 returns once all have."""
        if self.world is not None and self.rank == 0:
            encoded = url.encode()
            self._command(_SAVE, len(encoded))
            torch.distributed.broadcast(torch.tensor(list(encoded), dtype=torch.uint8), 0)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "checkpoint"
            self.engine.save_checkpoint(str(local / "deepspeed"), tag=f"step{self.step}")
            if self.rank == 0:
                self.engine.module.save_pretrained(str(local / "hf"), safe_serialization=True)
                (local / "trainer_state.json").write_text(
                    json.dumps(
                        {
                            "step": self.step,
                            "version": self.version,
                            "ranks": self.ranks,
                            "config": self.config.model_dump(),
                        }
                    )
                )
            fs, root = fsspec.core.url_to_fs(url)
            root = root.rstrip("/")
            for path in sorted(p for p in local.rglob("*") if p.is_file()):  # ranks write other files
                target = f"{root}/{path.relative_to(local).as_posix()}"
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(str(path), target)
        if self.world is not None:
            torch.distributed.barrier()  # every share is in storage before the step can be committed
        return url

    def load_checkpoint(self, url: str) -> None:
        fs, root = fsspec.core.url_to_fs(url)
        root = root.rstrip("/")
        with tempfile.TemporaryDirectory() as tmp:
            for path in fs.find(root):  # every file but the other ranks' optimizer shares
                name = path.rsplit("/", 1)[-1]
                if name.startswith("zero_pp_rank_") and not name.startswith(f"zero_pp_rank_{self.rank}_"):
                    continue
                target = Path(tmp) / path[len(root) + 1 :]
                target.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(path, str(target))
            local = Path(tmp)
            state = json.loads((local / "trainer_state.json").read_text())
            if state.get("ranks", 1) != self.ranks and self.config.zero_stage > 0:
                raise ValueError(
                    f"the checkpoint {url} holds ZeRO stage {self.config.zero_stage} optimizer shares of "
                    f"{state.get('ranks', 1)} core ranks; this core has {self.ranks} (keep [cluster] "
                    "core_hosts as the campaign started, or train with zero_stage 0)"
                )
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
