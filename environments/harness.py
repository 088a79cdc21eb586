"""The built-in coding-agent harness: a multi-turn tool-using agent that reaches the model ONLY through
the `openai` client (base_url + api_key), exactly as an external harness would.

One execution = one `python -m environments.harness` process (the dispatcher starts it and stops it at
the deadline). The main agent works in a sandboxed workspace with seven tools:

    list_files(path)  read_file(path)  write_file(path, content)  run(command)
    run_tests()       delegate(instruction)                       finish(summary)

and three mechanisms that give an execution's prefix-shared tree its shape:

- context compression: when a call's context passes ``context_budget_tokens`` the agent makes a
  summary call (role ``main_summary``, or ``sub_summary`` in a sub-agent) and continues from a new
  context built from the instruction and that summary;
- sub-agents: ``delegate`` runs a sub-agent with its own context (role ``sub``, its own agent id, so
  the gateway gives it its own engine session) and returns its finish summary as the tool result;
- retries by branching: a failed call (an API error) or a failed step (no parsable tool call, an
  unknown tool, bad arguments, a refused path) is sampled again from the same earlier context, up to
  ``max_retries`` times; the abandoned output stays recorded by the gateway as a branch.

Every call carries its role and agent to the gateway in the X-Gyre-Role / X-Gyre-Agent headers (an
unmodified harness that sends neither is recorded as the main agent). Progress (calls, branches, ...)
is rewritten to ``--result`` after every call, so a harness stopped at its deadline still reports it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai

from environments.harness_config import HarnessConfig
from environments.problems import PublicProblem
from environments.sandbox import Sandbox, SandboxViolation
from environments.tools import TOOL_NAMES, TOOL_SPECS

SYSTEM_PROMPT = (
    "You are a coding agent working in a sandboxed workspace. Use the tools to inspect and change files "
    "and to run commands. Call finish when the task is done."
)
SUMMARY_REQUEST = (
    "Your context is full. Summarize what you have done so far and what is left, in a few lines, "
    "so that you can continue from the summary alone."
)
NUDGE = "Reply with exactly one tool call. Call finish when the task is done."


def _tool(name: str) -> dict[str, Any]:
    description, arguments = TOOL_SPECS[name]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    key: {"type": "string", "description": text} for key, text in arguments.items()
                },
                "required": list(arguments),
            },
        },
    }


TOOLS = [_tool(name) for name in TOOL_NAMES]
SUB_AGENT_TOOLS = [t for t in TOOLS if t["function"]["name"] != "delegate"]


@dataclass
class HarnessStats:
    """What the harness reports (the dispatcher reads it even after a deadline kill)."""

    status: str = "running"  # running | finished | out_of_turns | crashed
    calls: int = 0
    branches: int = 0
    summaries: int = 0
    subagents: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    api_errors: int = 0
    violations: list[str] = field(default_factory=list)
    finish_summary: str | None = None
    error: str | None = None


class StepFailed(Exception):
    """A step that is retried by branching: no tool call, unknown tool, bad arguments, refused path."""


class Harness:
    def __init__(
        self,
        client: openai.OpenAI,
        sandbox: Sandbox,
        problem: PublicProblem,
        config: HarnessConfig,
        result_path: str | Path | None = None,
    ):
        self.client = client
        self.sandbox = sandbox
        self.problem = problem
        self.config = config
        self.result_path = Path(result_path) if result_path else None
        self.stats = HarnessStats()
        self._seed = config.seed

    def run(self) -> HarnessStats:
        try:
            summary = self._agent("main", "main", "main_summary", self.problem.instruction, TOOLS)
            self.stats.finish_summary = summary
            self.stats.status = "finished" if summary is not None else "out_of_turns"
        except Exception as exc:  # the process still reports what it did; the dispatcher marks an error
            self.stats.status = "crashed"
            self.stats.error = f"{type(exc).__name__}: {exc}"
            self._report()
            raise
        self._report()
        return self.stats

    # -- one agent's loop ------------------------------------------------------------------------
    def _agent(self, agent_id: str, role: str, summary_role: str, instruction: str, tools) -> str | None:
        turns = self.config.max_turns if agent_id == "main" else self.config.sub_max_turns
        fresh = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
        messages = list(fresh)
        context_tokens = 0
        for _ in range(turns):
            if context_tokens > self.config.context_budget_tokens:  # also after a failed step
                messages = self._compress(messages, fresh, agent_id, summary_role)
                context_tokens = 0
            outcome = None
            for attempt in range(self.config.max_retries + 1):
                message, context_tokens = self._call(messages, agent_id, role, tools)
                try:
                    calls = _tool_calls(message)
                    outcome = [self.execute_tool(call, agent_id) for call in calls]
                    break
                except StepFailed as failure:
                    if attempt == self.config.max_retries:  # out of retries: the failure becomes context
                        outcome = failure
                    else:
                        self.stats.branches += 1  # sample again from the same context
            assistant = _assistant_message(message)
            messages.append(assistant)
            if isinstance(outcome, StepFailed):
                if assistant.get("tool_calls"):
                    messages += [
                        {"role": "tool", "tool_call_id": c["id"], "content": f"error: {outcome}"}
                        for c in assistant["tool_calls"]
                    ]
                else:
                    messages.append({"role": "user", "content": f"{outcome}. {NUDGE}"})
                continue
            finished = None
            for call, (result, done) in zip(assistant["tool_calls"], outcome, strict=True):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                if done is not None:
                    finished = done
            if finished is not None:
                return finished
        return None

    def _compress(self, messages, fresh, agent_id: str, summary_role: str) -> list[dict[str, Any]]:
        request = [*messages, {"role": "user", "content": SUMMARY_REQUEST}]
        message, _ = self._call(
            request, agent_id, summary_role, None, max_tokens=self.config.summary_max_tokens
        )
        self.stats.summaries += 1
        summary = (message.content or "").strip() or "(no summary)"
        return [
            fresh[0],
            {"role": "user", "content": f"{fresh[1]['content']}\n\nProgress so far:\n{summary}"},
        ]

    def _call(self, messages, agent_id: str, role: str, tools, *, max_tokens: int | None = None):
        """One model call; API errors are retried from the same context (a branch each), a broken
        connection sent again (connection_retries)."""
        attempt, broken = 0, 0
        self._seed += 1
        while True:
            try:
                response = self.client.chat.completions.create(
                    model=self.config.model,
                    messages=messages,
                    tools=tools or openai.NOT_GIVEN,
                    max_tokens=max_tokens or self.config.max_tokens,
                    temperature=self.config.temperature,
                    seed=self._seed,
                    extra_headers={"X-Gyre-Role": role, "X-Gyre-Agent": agent_id},
                )
            except (openai.InternalServerError, openai.APITimeoutError):
                self.stats.api_errors += 1
                if attempt == self.config.max_retries:
                    raise
                attempt += 1
                self._seed += 1
                self.stats.branches += 1
                time.sleep(0.2 * attempt)
                continue
            except openai.APIConnectionError:  # (APITimeoutError, a subclass, is caught above)
                self.stats.api_errors += 1
                broken += 1
                if broken > self.config.connection_retries:
                    raise
                time.sleep(0.2 * broken)  # the same call again, same seed: nothing was answered
                continue
            self.stats.calls += 1
            self._report()
            usage = response.usage
            context = (usage.prompt_tokens + usage.completion_tokens) if usage else 0
            return response.choices[0].message, context

    # -- tools -----------------------------------------------------------------------------------
    def execute_tool(self, call: dict[str, Any], agent_id: str) -> tuple[str, str | None]:
        """Runs one tool call; returns (result text, finish summary or None). Raises StepFailed."""
        name, arguments = call["name"], call["arguments"]
        self.stats.tool_calls += 1
        sandbox = self.sandbox

        def arg(key: str) -> str:
            value = arguments.get(key)
            if not isinstance(value, str):
                self.stats.tool_errors += 1
                raise StepFailed(f"{name} needs a string argument {key!r}")
            return value

        try:
            if name == "list_files":
                folder = arguments.get("path") or "."
                if not isinstance(folder, str):
                    raise StepFailed("list_files needs a string argument 'path'")
                return "\n".join(sandbox.list_files(folder)) or "(no files)", None
            if name == "read_file":
                return sandbox.read_file(arg("path")), None
            if name == "write_file":
                path = arg("path")
                sandbox.write_file(path, arg("content"))
                return f"wrote {path}", None
            if name == "run":
                return _command_text(
                    sandbox.run(arg("command"), timeout_s=self.config.command_timeout_s)
                ), None
            if name == "run_tests":
                command = self.problem.visible_test_command
                if not command:
                    return "this problem has no visible tests", None
                return _command_text(sandbox.run(command, timeout_s=self.config.command_timeout_s)), None
            if name == "delegate" and agent_id == "main":
                return self._delegate(arg("instruction")), None
            if name == "finish":
                summary = arguments.get("summary")
                return "finished", summary if isinstance(summary, str) else ""
        except SandboxViolation as exc:
            self.stats.violations.append(str(exc))
            self.stats.tool_errors += 1
            raise StepFailed(f"refused: {exc}") from exc
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            # whatever the workspace makes a file tool meet (a loop, a full disk, a NUL in a path)
            # is the tool's answer, never the harness's crash: a crashed execution is never trained
            # on, so a crash would be an escape from its reward
            self.stats.tool_errors += 1
            return f"error: {exc}", None
        self.stats.tool_errors += 1
        raise StepFailed(f"unknown tool {name!r}")

    def _delegate(self, instruction: str) -> str:
        if self.stats.subagents >= self.config.max_subagents:
            return f"error: at most {self.config.max_subagents} sub-agents per execution"
        self.stats.subagents += 1
        agent_id = f"sub{self.stats.subagents}"
        summary = self._agent(agent_id, "sub", "sub_summary", instruction, SUB_AGENT_TOOLS)
        return summary if summary is not None else "the sub-agent ran out of turns"

    def _report(self) -> None:
        if self.result_path is None:
            return
        temporary = self.result_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(self.stats)))
        os.replace(temporary, self.result_path)


def _tool_calls(message) -> list[dict[str, Any]]:
    """The message's tool calls with parsed JSON arguments; StepFailed when there are none or they are
    not JSON objects."""
    calls = []
    for call in message.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as exc:
            raise StepFailed(f"the arguments of {call.function.name} are not JSON ({exc.msg})") from exc
        if not isinstance(arguments, dict):
            raise StepFailed(f"the arguments of {call.function.name} are not a JSON object")
        calls.append({"id": call.id, "name": call.function.name, "arguments": arguments})
    if not calls:
        raise StepFailed("no tool call in the reply")
    return calls


def _assistant_message(message) -> dict[str, Any]:
    """The reply exactly as the gateway returned it (content and tool calls with their ids), so that
    resending it lets the gateway reuse the exact generated tokens."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
    return out


def _command_text(result, limit: int = 4000) -> str:
    text = f"exit code {result.returncode}"
    if result.limit:
        text += f" (stopped: {result.limit} limit)"
    body = (result.stdout + ("\n" + result.stderr if result.stderr else "")).strip()
    if len(body) > limit:
        body = body[: limit // 2] + "\n...\n" + body[-limit // 2 :]
    return f"{text}\n{body}" if body else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m environments.harness", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--problem", required=True, help="the problem as a harness sees it (PublicProblem JSON: no grader)"
    )
    parser.add_argument("--workspace", required=True, help="the execution's workspace folder")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--result", required=True, help="where progress and the final stats go (JSON)")
    parser.add_argument("--config", default="{}", help="HarnessConfig fields as JSON")
    args = parser.parse_args(argv)
    problem = PublicProblem.from_json(json.loads(Path(args.problem).read_text()))
    config = HarnessConfig.from_dict(json.loads(args.config))
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600)
    # the workspace's parent holds the other executions' workspaces: commands see it empty
    sandbox = Sandbox(args.workspace, config.limits, hide_root=Path(args.workspace).resolve().parent)
    stats = Harness(client, sandbox, problem, config, args.result).run()
    print(json.dumps({"status": stats.status, "calls": stats.calls, "branches": stats.branches}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
