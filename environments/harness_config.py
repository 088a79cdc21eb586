"""HarnessConfig: how the built-in agent behaves (the ``[dispatch.harness]`` section of a campaign).

Its own module, apart from environments/harness.py (which imports the ``openai`` client), so a
campaign config is read and checked without loading the harness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from environments.sandbox import SandboxLimits


@dataclass
class HarnessConfig:
    """How the built-in agent behaves (one section of the rollout config)."""

    model: str = "policy"
    """Model name sent to the gateway (it serves one policy; the name is informational)."""
    max_turns: int = 12
    """Tool-using turns of the main agent before it stops on its own (the dispatcher's deadline may stop
    it earlier)."""
    sub_max_turns: int = 4
    """Turns of each sub-agent."""
    max_subagents: int = 2
    """Delegations per execution; more are answered with an error result."""
    context_budget_tokens: int = 2048
    """Compress (summary call + new context) once a call's prompt + output pass this many tokens."""
    max_tokens: int = 192
    """Output tokens per call."""
    summary_max_tokens: int = 128
    """Output tokens of a summary (context-compression) call."""
    temperature: float = 1.0
    """Sampling temperature of every call (0: greedy)."""
    max_retries: int = 2
    """Re-samples from the same context after a failed call or step (each one is a branch)."""
    connection_retries: int = 3
    """Sends a call again after its connection failed (the gateway died before answering: the relay
    then reaches the execution's standby gateway, environments/relay.py); no answer was recorded, so
    this is no branch and takes none of max_retries."""
    seed: int = 0
    """Base sampling seed; every call gets its own seed derived from it, so reruns are reproducible."""
    command_timeout_s: float = 20.0
    """Wall-clock limit of one shell command the agent runs (the sandbox kills it there)."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HarnessConfig:
        data = dict(data)
        limits = SandboxLimits(**data.pop("limits", {}))
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown harness config fields {sorted(unknown)}")
        return cls(**data, limits=limits)
