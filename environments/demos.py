"""Demonstrations for the supervised warm start: a problem's reference solution played through the
built-in harness's tools, as the conversation the harness would have had.

The messages use the harness's own system prompt and tool list, every action is executed for real in
a sandbox (so tool results are what the agent would have seen) and the conversation ends with a
``finish`` call. `engines.train.sft` renders them with the policy's chat template.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

from environments.harness import SYSTEM_PROMPT, TOOLS, Harness, HarnessConfig, StepFailed
from environments.problems import Problem
from environments.sandbox import Sandbox


def demonstration(problem: Problem, config: HarnessConfig | None = None) -> list[dict[str, Any]]:
    """The message list of one solved execution of ``problem`` (raises if the solution misbehaves)."""
    config = config or HarnessConfig()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem.instruction},
    ]
    actions = list(problem.solution)
    if not actions or actions[-1]["tool"] != "finish":  # the generators' solutions end with their own
        actions.append({"tool": "finish", "arguments": {"summary": "done"}})
    with tempfile.TemporaryDirectory(prefix="gyre-demo-") as root:
        sandbox = Sandbox.create(root, "workspace", problem.files, config.limits)
        harness = Harness(None, sandbox, problem.public(), config)  # no client: only its tools are used
        for index, action in enumerate(actions):
            call_id = f"call_{index}"
            arguments = action.get("arguments", {})
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": action["tool"], "arguments": json.dumps(arguments)},
                        }
                    ],
                }
            )
            try:
                result, _ = harness.execute_tool({"name": action["tool"], "arguments": arguments}, "main")
            except StepFailed as exc:
                raise ValueError(
                    f"the reference solution of {problem.problem_id} fails at {action}: {exc}"
                ) from exc
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return messages


def demonstrations(problems: list[Problem]) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """(messages, tools) pairs, the input of engines.train.sft.train_sft."""
    return [(demonstration(problem), TOOLS) for problem in problems]
