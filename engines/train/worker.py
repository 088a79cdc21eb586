"""GradWorker: gradients of the policy loss on a plain torch copy of the weights.

Satellites are GradWorkers in their own processes; the core cell computes its share of a step
with one too, so every micro-batch's gradient is computed the same way wherever it runs. Gradient
SUMS accumulate in a flat fp64 buffer (one slice per parameter, in a fixed order) ready for one
reduction: in fp64 the sum does not depend on which participant added which micro-batch or in what
order, so an elastic step gives the single-process update to the last fp32 bit in practice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engines.train.config import LossConfig
from engines.train.loss import LossTerms, policy_loss
from engines.train.tree import Kernel, target_logprobs
from trajectory_store.processor import PackedSequence


def at_targets(array: np.ndarray, targets: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A per-token column of a packed sequence (behaviour logprobs, advantages, weights) at its
    targets, as float32 on ``device``."""
    return torch.as_tensor(array[targets], dtype=torch.float32, device=device)


def sequence_loss(
    model: torch.nn.Module,
    sequence: PackedSequence,
    n_executions: int,
    config: LossConfig,
    *,
    kernel: Kernel = "blocks",
) -> tuple[LossTerms, np.ndarray]:
    """The policy loss of one packed sequence from one tree-packed forward, and its target indices."""
    out = target_logprobs(model, sequence, kernel=kernel)
    targets = out.targets.cpu().numpy()
    device = out.logprobs.device
    terms = policy_loss(
        out.logprobs,
        at_targets(sequence.behaviour_logprobs, targets, device),
        at_targets(sequence.advantages, targets, device),
        at_targets(sequence.weights, targets, device),
        n_executions,
        config,
        entropy=out.entropy,
    )
    return terms, targets


@dataclass
class StepStats:
    """Sums over the micro-batches a worker processed (added across workers at the end of a step)."""

    micro_batches: list[int] = field(default_factory=list)
    loss: float = 0.0
    tokens: int = 0
    clipped: int = 0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    entropy_sum: float = 0.0
    kl_sum: float = 0.0
    lag_sum: float = 0.0
    lag_max: int = 0

    def add(self, other: StepStats) -> None:
        self.micro_batches += other.micro_batches
        for name in ("loss", "tokens", "clipped", "ratio_sum", "entropy_sum", "kl_sum", "lag_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.lag_max = max(self.lag_max, other.lag_max)

    def as_vector(self) -> list[float]:
        return [
            self.loss,
            self.tokens,
            self.clipped,
            self.ratio_sum,
            self.entropy_sum,
            self.kl_sum,
            self.lag_sum,
        ]

    @classmethod
    def from_vector(
        cls, values: list[float], ratio_max: float, lag_max: int, micro_batches: list[int]
    ) -> StepStats:
        loss, tokens, clipped, ratio_sum, entropy_sum, kl_sum, lag_sum = values
        return cls(
            micro_batches, loss, round(tokens), round(clipped), ratio_sum, ratio_max, entropy_sum, kl_sum,
            lag_sum, lag_max,
        )  # fmt: skip


class GradWorker:
    def __init__(self, model: torch.nn.Module, loss: LossConfig):
        self.model = model
        self.loss_config = loss
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float64)
        self.version = -1

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        real_missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
        if real_missing or unexpected:
            raise ValueError(
                f"weights v{version} do not fit the model: missing {real_missing}, extra {unexpected}"
            )
        self.version = version

    def reset(self) -> None:
        self.grad.zero_()

    def accumulate(
        self, sequence: PackedSequence, n_executions: int | None, index: int, version: int
    ) -> StepStats:
        """Adds the gradient of one micro-batch's share of the step loss to the flat buffer.

        ``n_executions`` None: the step's normalizer is not known yet (a streaming step), so the
        gradient and loss are added unnormalized and the core divides the reduced sum by it."""
        self.model.train()
        normalizer = 1 if n_executions is None else n_executions  # x / 1 is exact: unnormalized
        terms, targets = sequence_loss(self.model, sequence, normalizer, self.loss_config)
        # autograd.grad, not backward: nothing accumulates into .grad, so the core's DeepSpeed engine,
        # whose module this may be, sees no gradient through its hooks (core.py)
        grads = torch.autograd.grad(terms.loss, self.params, allow_unused=True)
        offset = 0
        for param, grad in zip(self.params, grads, strict=True):
            n = param.numel()
            if grad is not None:
                self.grad[offset : offset + n] += grad.detach().reshape(-1).double().cpu()
            offset += n
        del grads
        lags = version - sequence.policy_versions[targets]
        return StepStats(
            micro_batches=[index],
            loss=float(terms.loss.detach()),
            lag_sum=float(lags.sum()),
            lag_max=int(lags.max()) if lags.size else 0,
            **terms.figures(),
        )
