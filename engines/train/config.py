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
        description="DeepSpeed ZeRO stage of the core cell. In a one-rank DeepSpeed world (the default) no "
        "stage shards anything; 0 steps the module's own parameters (in float32: one full-precision copy "
        "of the policy), while 1 and 2 also keep a float32 master partition, a second copy in float32 "
        "(python -m bench.train_memory counts them). In a core of several ranks (CoreWorld: [cluster] "
        "core_hosts) 1 and 2 split the optimizer state (and the master copy) across the ranks. Stage 3 "
        "shards parameters too and is not supported by the elastic core yet (the satellites' gradients "
        "are injected into the core's full parameters)",
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


class CoreWorld(BaseModel):
    """The core as a DeepSpeed world of several ranks, one process each, on one host or several: rank
    0 is the trainer process (it computes the step's gradients with the satellites and sends their sum
    to the others); every rank holds the weights and its share of the optimizer state (ZeRO 1-2), and
    every rank steps. engines/train/peer.py is a rank above 0."""

    address: str = Field(description="rank 0's address on the network the ranks share: the rendezvous")
    port: int = Field(ge=1, le=65535, description="the rendezvous port at rank 0 (torch's TCPStore)")
    size: int = Field(ge=2, le=64, description="ranks in the world, rank 0 included")
    rank: int = Field(0, ge=0, description="this process's rank")
    local_address: str | None = Field(
        None,
        description="this rank's own address (gloo binds to the interface that holds it); None: address "
        "(rank 0, or every rank on one host)",
    )
    timeout_s: float = Field(
        120.0, gt=0, description="how long a collective waits for a rank before the step fails"
    )
