"""The sizes of one GPU-check run: the GPU plan (bf16, the gpu-0.5b / gpu-1.5b presets), or the CPU
fallback's tiny one; the sections in order and what each one must hold once it measured anything."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SECTIONS = ("engine", "train", "deepspeed", "role_switch", "migration", "vllm")
MEASURED = {  # the key that holds a section's figures once it measured anything
    "engine": "runs",
    "train": "runs",
    "deepspeed": "mean_step_s",
    "role_switch": "cycles",
    "migration": "runs",
    "vllm": "start_s",
}
GOALS_S = {"rollout_to_train": 3.0, "train_to_rollout": 1.5}


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU plan, or the CPU fallback's tiny one."""

    dtype: Literal["bfloat16", "float32"]
    engine_presets: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    turns: int
    max_tokens: int
    first_prompt_tokens: tuple[int, int]
    tool_tokens: tuple[int, int]
    train_presets: tuple[str, ...]
    train_size: dict  # bench/train.py's workload sizes
    train_sequences: int | None  # packed sequences trained (None: all of them)
    train_repeats: int
    deepspeed_preset: str
    deepspeed_steps: int
    switch_preset: str
    switch_context: int
    migration_preset: str
    migration_contexts: tuple[int, ...]
    migration_repeats: int
    vllm_preset: str | None  # the model vLLM serves; None: the shipped policy data/policies/tiny-sft
    vllm_gpu_memory_utilization: (
        float  # vLLM's share of the GPU (weights + KV), so the check's own CUDA context fits
    )
    shares: dict  # section -> share of the remaining budget it may use
    min_s: dict  # section -> seconds it needs to be worth starting

    def presets(self, sections: tuple[str, ...]) -> list[str]:
        """The presets the given sections use, each once."""
        used = {
            "engine": self.engine_presets,
            "train": self.train_presets,
            "deepspeed": (self.deepspeed_preset,),
            "role_switch": (self.switch_preset,),
            "migration": (self.migration_preset,),
            "vllm": (self.vllm_preset,) if self.vllm_preset else (),
        }
        return list(dict.fromkeys(preset for name in sections for preset in used[name]))


def make_plan(cuda: bool, quick: bool) -> Plan:
    """The GPU plan on CUDA, else the tiny CPU fallback; ``quick`` shrinks either."""
    # vllm: its start alone takes 30-60 s on CPU, less on a GPU; last, so it gets what the others leave
    shares = {
        "engine": 0.3,
        "train": 0.15,
        "deepspeed": 0.12,
        "role_switch": 0.08,
        "migration": 0.15,
        "vllm": 0.2,
    }
    if cuda:
        big = ("gpu-0.5b",) if quick else ("gpu-0.5b", "gpu-1.5b")
        role = "gpu-0.5b" if quick else "gpu-1.5b"
        return Plan(
            dtype="bfloat16",
            engine_presets=big,
            batch_sizes=(1, 16) if quick else (1, 16, 64),
            turns=3,
            max_tokens=64,
            first_prompt_tokens=(200, 400),
            tool_tokens=(100, 300),
            train_presets=big,
            train_size={"max_context": 6000, "max_turns": 24, "budget": 8192, "executions": 8},
            train_sequences=None,
            train_repeats=2,
            deepspeed_preset=role,
            deepspeed_steps=3,
            switch_preset=role,
            switch_context=2048,
            migration_preset=role,
            migration_contexts=(2048,) if quick else (2048, 8192),
            migration_repeats=3,
            vllm_preset=big[0],
            vllm_gpu_memory_utilization=0.3,
            shares=shares,
            min_s={
                "engine": 40,
                "train": 25,
                "deepspeed": 30,
                "role_switch": 20,
                "migration": 40,
                "vllm": 60,
            },
        )
    return Plan(
        dtype="float32",
        engine_presets=("tiny",),
        batch_sizes=(1, 4),
        turns=2 if quick else 3,
        max_tokens=8 if quick else 16,
        first_prompt_tokens=(32, 64),
        tool_tokens=(20, 60),
        train_presets=("tiny",),
        train_size={"max_context": 400, "max_turns": 4, "budget": 512, "executions": 4},
        train_sequences=3 if quick else None,
        train_repeats=1 if quick else 2,
        deepspeed_preset="tiny",
        deepspeed_steps=1 if quick else 2,
        switch_preset="tiny",
        switch_context=128 if quick else 256,
        migration_preset="tiny",
        migration_contexts=(128,) if quick else (256, 1024),
        migration_repeats=1 if quick else 2,
        vllm_preset=None,
        vllm_gpu_memory_utilization=0.3,
        shares=shares,
        min_s={"engine": 3, "train": 3, "deepspeed": 3, "role_switch": 3, "migration": 5, "vllm": 60},
    )
