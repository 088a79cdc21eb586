"""Demonstrations for the supervised warm start: a problem's reference solution played through the
built-in harness's tools, as the conversation the harness would have had.

The messages use the harness's own system prompt and tool list, every action is executed for real in
a sandbox (so tool results are what the agent would have seen) and the conversation ends with a
``finish`` call. `engines.train.sft` renders them with the policy's chat template.

A recovery demonstration (``recover=True``) first makes the mistake the warm start makes most (it
writes the file it must fix back unchanged), runs the visible tests and sees them fail, reads the
file again, writes the fix, runs them again and finishes. The mistake's turn carries ``"train":
False``: the policy learns to notice a failed test and try again, never to make the mistake. No
demonstration retried before, so a policy never sampled a retry that RL could reward.

A give-up demonstration (``give_up=True``) calls ``finish``, with the reference's own summary, before
doing anything: the premature finish of agents that declare a task done without doing it. A warm start
trained on a share of them gives up at about that rate, on any problem: a failure that is a decision,
the same on every problem, which RL can find and unlearn (the faithful warm start's failures are
copy errors, each specific to its problem; README, "does it learn?").
"""

from __future__ import annotations

import json
import random
import tempfile
from typing import Any

from environments.harness import SYSTEM_PROMPT, TOOLS, Harness, HarnessConfig, StepFailed
from environments.problems import Problem
from environments.sandbox import Sandbox


def demonstration(
    problem: Problem, config: HarnessConfig | None = None, *, recover: bool = False, give_up: bool = False
) -> list[dict[str, Any]]:
    """The message list of one solved execution of ``problem`` (raises if the solution misbehaves);
    ``recover``: with a failed first attempt (raises if the problem has none, see ``can_recover``);
    ``give_up``: only the final ``finish`` call, nothing solved."""
    if recover and give_up:
        raise ValueError(f"{problem.problem_id}: a demonstration either recovers or gives up, not both")
    config = config or HarnessConfig()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem.instruction},
    ]
    actions = list(problem.solution)
    if not actions or actions[-1]["tool"] != "finish":  # the generators' solutions end with their own
        actions.append({"tool": "finish", "arguments": {"summary": "done"}})
    if recover:
        actions = _with_a_failed_attempt(problem, actions)
    if give_up:
        actions = actions[-1:]
    with tempfile.TemporaryDirectory(prefix="gyre-demo-") as root:
        sandbox = Sandbox.create(root, "workspace", problem.files, config.limits)
        harness = Harness(None, sandbox, problem.public(), config)  # no client: only its tools are used
        for index, action in enumerate(actions):
            call_id = f"call_{index}"
            arguments = action.get("arguments", {})
            turn = {
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
            if action.get("mistake"):
                turn["train"] = False
            messages.append(turn)
            try:
                result, _ = harness.execute_tool({"name": action["tool"], "arguments": arguments}, "main")
            except StepFailed as exc:
                raise ValueError(
                    f"the reference solution of {problem.problem_id} fails at {action}: {exc}"
                ) from exc
            if action.get("must_fail") and not _tests_failed(result):
                raise ValueError(
                    f"{problem.problem_id}: the visible tests pass after the mistake: {result!r}"
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return messages


def _tests_failed(result: str) -> bool:
    """A run_tests result that shows a failure (the visible test scripts print FAIL lines; a crash exits
    non-zero)."""
    return not result.startswith("exit code 0") or "\nFAIL " in result


def can_recover(problem: Problem) -> bool:
    """Whether a recovery demonstration exists: visible tests, and a reference write of a shipped file
    that changes it (writing it back unchanged is then the mistake)."""
    return _first_fix(problem) is not None


def _first_fix(problem: Problem) -> int | None:
    if not problem.visible_test_command:
        return None
    for index, action in enumerate(problem.solution):
        if action["tool"] == "write_file":
            path = action["arguments"]["path"]
            if path in problem.files and problem.files[path] != action["arguments"]["content"]:
                return index
    return None


def _with_a_failed_attempt(problem: Problem, actions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    index = _first_fix(problem)
    if index is None:
        raise ValueError(
            f"{problem.problem_id}: no recovery demonstration (no visible tests or no fixing write)"
        )
    path = actions[index]["arguments"]["path"]
    mistake = {
        "tool": "write_file",
        "arguments": {"path": path, "content": problem.files[path]},
        "mistake": True,
    }
    failing = {"tool": "run_tests", "arguments": {}, "must_fail": True}
    # read the file again before the second write: the text to copy sits right before it, as in a first
    # attempt (without it, a 3M-parameter policy retried but mangled the file it copied from further back)
    again = {"tool": "read_file", "arguments": {"path": path}}
    return [*actions[:index], mistake, failing, again, *actions[index:]]


def gives_up(messages: list[dict[str, Any]]) -> bool:
    """Whether a conversation's first assistant turn is already ``finish``."""
    first = next((m for m in messages if m["role"] == "assistant"), None)
    return bool(first and first.get("tool_calls")) and first["tool_calls"][0]["function"]["name"] == "finish"


def demonstrations(
    problems: list[Problem], recovery_share: float = 0.0, seed: int = 0, give_up_share: float = 0.0
) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """(messages, tools) pairs, the input of engines.train.sft.train_sft; ``recovery_share`` of the
    problems that allow one are demonstrated with a failed first attempt, ``give_up_share`` of the
    others give up at once (both drawn with ``seed``)."""
    if not (0.0 <= recovery_share <= 1.0 and 0.0 <= give_up_share <= 1.0):
        raise ValueError(
            f"recovery_share {recovery_share} and give_up_share {give_up_share} must lie in [0, 1]"
        )
    rng, give_up_rng = random.Random(seed), random.Random(f"give up {seed}")  # each share its own draws
    pairs = []
    for problem in problems:
        recover = can_recover(problem) and rng.random() < recovery_share
        give_up = give_up_rng.random() < give_up_share and not recover
        pairs.append((demonstration(problem, recover=recover, give_up=give_up), TOOLS))
    return pairs
