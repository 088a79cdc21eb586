"""Typed configuration of training: the loss and the trainer backends."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class LossConfig(BaseModel):
    """PPO-style clipped policy loss over the behaviour logprobs recorded at rollout time."""

    clip_low: float = Field(0.2, ge=0, description="ratio is clipped below at 1 - clip_low")
    clip_high: float = Field(
        0.28, ge=0, description="ratio is clipped above at 1 + clip_high (DAPO clip-higher)"
    )
    kl_coef: float = Field(
        0.0, ge=0, description="weight of a k3 KL estimate against the behaviour policy (off by default)"
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of an entropy bonus (off by default)")


class TrainerConfig(BaseModel):
    """The core cell's optimizer and DeepSpeed settings; satellites only need the loss."""

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="AdamW's (momentum, second-moment) decay rates; 0 first: no momentum"
    )
    eps: float = Field(1e-8, gt=0, description="AdamW's denominator floor (1e-3: near-SGD steps)")
    max_grad_norm: float = Field(1.0, ge=0, description="global gradient-norm clip; 0 turns it off")
    zero_stage: Literal[0, 1, 2] = Field(
        0,
        description="DeepSpeed ZeRO stage of the core cell. The core is a one-rank DeepSpeed world, so no "
        "stage shards anything; 0 steps the module's own parameters (in float32: one full-precision copy "
        "of the policy), while 1 and 2 also keep a float32 master partition, a second copy in float32 "
        "(python -m bench.train_memory counts them). Stage 3 shards parameters across a DeepSpeed world "
        "and is not supported by the elastic core yet (the satellites' gradients are injected into the "
        "core's full parameters)",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="training dtype (bfloat16 on GPUs)")
    mini_batches: int = Field(
        1,
        ge=1,
        description="optimizer updates per pass over a step's batch: its packed sequences are split into "
        "this many mini-batches (balanced by tokens) and each one is an AdamW update; after the first, the "
        "PPO clip against the behaviour logprobs is what keeps the policy near the one that sampled. "
        "Each mini-batch's loss keeps the step's normalizer, so at equal weights the mini-batch gradients "
        "add up to the whole batch's. 1: one update per step (a streaming step is always 1)",
    )
    epochs: int = Field(
        1,
        ge=1,
        description="passes over a step's batch (PPO epochs); updates per step = epochs x mini_batches",
    )
    loss: LossConfig = Field(default_factory=LossConfig)

    @property
    def updates_per_step(self) -> int:
        return self.epochs * self.mini_batches
