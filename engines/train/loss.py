"""The policy loss: PPO-style clipping of the importance ratio against the behaviour logprobs.

Per-execution token averaging (DESIGN.md 5): the processor gives every target token of an
execution the weight 1 / (its training tree's policy tokens), so sum(weight * token_loss) over an
execution is its mean token loss; dividing by the step's number of executions averages over
executions. The normalizer is the step's, not the micro-batch's, so micro-batch gradients add up
to the full-batch gradient however the step is split across cells.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engines.train.config import LossConfig


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, already divided by the step's number of executions
    tokens: int
    clipped: int  # targets whose ratio was clipped (the clipped term was the active one)
    ratio_sum: float
    ratio_max: float
    entropy_sum: float
    kl_sum: float

    def figures(self) -> dict[str, float]:
        """Every term but the loss tensor, as the plain numbers they are (what a StepStats sums)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "loss"}


def policy_loss(
    logprobs: torch.Tensor,  # [n] current policy, differentiable
    behaviour_logprobs: torch.Tensor,  # [n] recorded at rollout time
    advantages: torch.Tensor,  # [n]
    weights: torch.Tensor,  # [n] 1 / policy tokens of the target's execution
    n_executions: int,
    config: LossConfig,
    entropy: torch.Tensor | None = None,  # [n]
) -> LossTerms:
    if n_executions <= 0:
        raise ValueError("a step must train at least one execution")
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantages
    token_loss = -torch.minimum(unclipped, clipped)
    kl = torch.exp(-log_ratio) - 1.0 + log_ratio  # k3 estimator of KL(behaviour || current)
    if config.kl_coef:
        token_loss = token_loss + config.kl_coef * kl
    if config.entropy_coef and entropy is not None:
        token_loss = token_loss - config.entropy_coef * entropy
    loss = (weights * token_loss).sum() / n_executions
    with torch.no_grad():
        active_clip = (clipped < unclipped) & (advantages != 0)
        return LossTerms(
            loss=loss,
            tokens=int(logprobs.numel()),
            clipped=int(active_clip.sum()),
            ratio_sum=float(ratio.sum()),
            ratio_max=float(ratio.max()) if ratio.numel() else 0.0,
            entropy_sum=float(entropy.sum()) if entropy is not None else 0.0,
            kl_sum=float(kl.sum()),
        )
