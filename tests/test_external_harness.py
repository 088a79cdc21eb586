"""An external harness (DispatchConfig.harness_command, or a problem's own) runs inside its
execution's sandbox: it reaches the gateway through the official ``openai`` client, and nothing
else; it and every command it starts see only their workspace (read-write), the system (read-only)
and their own installation; kept workspaces leave no quota mount behind. Real sandbox, real gateway
(tests/scripted_engine.py), real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from environments.dispatch import dispatch
from environments.dispatch_config import DispatchConfig
from environments.problems import Problem
from environments.sandbox import Sandbox, SandboxLimits, probe_isolation
from environments.sandbox_host import own_checkout, own_packages
from tests.scripted_engine import scripted_stack
from tests.test_gateway_fixtures import ADMIN_TOKEN
from tests.test_harness import two_file_problem
from trajectory_store.storage import Store

pytestmark = pytest.mark.slow
ISOLATION = probe_isolation()
needs_isolation = pytest.mark.skipif(
    not (ISOLATION.filesystem and ISOLATION.network), reason=f"no namespaces: {ISOLATION.detail}"
)

# One model call through the gateway, then a.txt: half of two_file_problem, reward 0.5. Each probe
# that succeeds stands for an answer stolen: the harness then writes b.txt too (reward 1.0).
AGENT = r"""
import json, os, socket, subprocess, sys
import openai

base_url, api_key, workspace, instruction = sys.argv[1:5]
probes = json.load(open(sys.argv[5])) if len(sys.argv) > 5 else {}
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
messages = [{"role": "user", "content": open(instruction).read()}]
reply = client.chat.completions.create(model="any", messages=messages, max_tokens=16)
open(os.path.join(workspace, "a.txt"), "w").write("alpha\n")
open(os.path.join(workspace, "reply.txt"), "w").write(reply.choices[0].message.content)
names = {
    "{ROOT}": os.path.dirname(workspace), "{WS}": os.path.basename(workspace),
    "{SIDE}": os.path.dirname(instruction), "{SIDENAME}": os.path.basename(os.path.dirname(instruction)),
}

def shell(command):  # a tool command, as an agent would run it
    for name, value in names.items():
        command = command.replace(name, value)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=20)
    return done.returncode == 0 and done.stdout.strip() != ""

stolen = {}
for path in probes.get("read", []):
    stolen["read " + path] = shell(f"head -c 64 {path}")
for command in probes.get("list", []):
    stolen["list " + command] = shell(command)
for path in probes.get("write", []):
    stolen["write " + path] = shell(f"echo x > {path} && echo written")
for port in probes.get("connect", []):
    stolen[f"connect {port}"] = shell(f"python -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 2); print(1)'")
if probes:
    open(os.path.join(workspace, "probes.json"), "w").write(json.dumps(stolen))
if any(stolen.values()):
    open(os.path.join(workspace, "b.txt"), "w").write("beta\n")
"""


def agent_command(tmp_path: Path, probes: dict | None = None) -> list[str]:
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    command = [sys.executable, str(agent), "{base_url}", "{api_key}", "{workspace}", "{instruction_file}"]
    if probes is None:
        return command
    (tmp_path / "probes.json").write_text(json.dumps(probes))
    return [*command, str(tmp_path / "probes.json")]


def run(stack, problems: list[Problem], tmp_path: Path, **config) -> list:
    config = DispatchConfig(workspace_root=str(tmp_path / "ws"), **config)
    return asyncio.run(dispatch(problems, stack.url, ADMIN_TOKEN, stack.store_config, config))


def quota_mounts(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as mounts:
        return [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]


@needs_isolation
def test_a_sandboxed_harness_calls_the_gateway_and_writes_its_workspace(tmp_path):
    with scripted_stack(str(tmp_path), lambda text: "hello from the model") as stack:
        [outcome] = run(
            stack, [two_file_problem("external")], tmp_path, harness_command=agent_command(tmp_path)
        )
        calls = stack.calls(outcome.execution_id)
    assert (outcome.status, outcome.reward, outcome.reward_source) == ("completed", 0.5, "final"), (
        outcome.error
    )
    assert outcome.calls == 1 and len(calls) == 1
    assert quota_mounts(tmp_path / "ws") == []


@needs_isolation
def test_a_harness_reaches_nothing_but_its_workspace_and_the_gateway(tmp_path, listening_port):
    """What the exploit probe did: read the checkout (problem generators, graders), the store and
    another execution's workspace, list the other workspaces and harness folders, write outside the
    workspace, connect to another loopback service. Every probe fails, so the exploit scores what
    the honest harness does."""
    with scripted_stack(str(tmp_path / "store"), lambda text: "ok") as stack:
        [honest] = run(
            stack,
            [two_file_problem("honest")],
            tmp_path,
            keep_workspaces=True,
            harness_command=agent_command(tmp_path),
        )
        stored = next(p for p in (tmp_path / "store").rglob("*") if p.is_file())
        [other_workspace] = (tmp_path / "ws").iterdir()  # kept: the honest execution's
        probes = {
            "read": [
                *(f"{c}/environments/problems/registry.py" for c in own_checkout()),
                *(f"{p}/__init__.py" for p in own_packages()),
                f"{other_workspace}/a.txt",
                str(stored),
            ],
            "list": [
                "ls -A {ROOT} | grep -v -x {WS}",
                "ls -A {SIDE}/.. | grep -v -x {SIDENAME}",
                f"ls -A {tmp_path}/store",
            ],
            "write": ["{ROOT}/planted", "{SIDE}/planted", f"{tmp_path}/store/planted", "/usr/planted"],
            "connect": [listening_port],
        }
        [exploit] = run(
            stack, [two_file_problem("exploit")], tmp_path, keep_workspaces=True,
            harness_command=agent_command(tmp_path, probes),
        )  # fmt: skip
    [workspace] = [w for w in (tmp_path / "ws").iterdir() if (w / "probes.json").exists()]
    seen = json.loads((workspace / "probes.json").read_text())
    assert len(seen) == sum(len(v) for v in probes.values()) and not any(seen.values()), seen
    assert (exploit.status, exploit.reward) == (honest.status, honest.reward) == ("completed", 0.5)
    assert not list(tmp_path.rglob("planted")) and not Path("/usr/planted").exists()


@needs_isolation
def test_kept_workspaces_keep_their_files_and_release_their_quota_mounts(tmp_path):
    with scripted_stack(str(tmp_path), lambda text: "kept") as stack:
        outcomes = run(
            stack,
            [two_file_problem("kept")],
            tmp_path,
            group_size=2,
            keep_workspaces=True,
            harness_command=agent_command(tmp_path),
        )
    assert [o.reward for o in outcomes] == [0.5, 0.5]
    workspaces = sorted((tmp_path / "ws").iterdir())
    assert len(workspaces) == 2
    for workspace in workspaces:
        assert sorted(p.name for p in workspace.iterdir()) == ["README.md", "a.txt", "reply.txt"]
        assert (workspace / "reply.txt").read_text() == "kept"
    assert quota_mounts(tmp_path / "ws") == []


# A harness installed in a virtualenv of its own (as pip installs one: a script whose #! names the
# venv's python, a module in its site-packages), called with plain urllib.
VENV_MODULE = r"""
import json, urllib.request

def ask(base_url, api_key, instruction):
    body = {"model": "any", "messages": [{"role": "user", "content": instruction}], "max_tokens": 16}
    request = urllib.request.Request(
        base_url + "/chat/completions", json.dumps(body).encode(),
        {"Authorization": "Bearer " + api_key, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["choices"][0]["message"]["content"]
"""


def venv_agent(tmp_path: Path) -> Path:
    venv = tmp_path / "agent-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    [site] = venv.glob("lib/python*/site-packages")
    (site / "venv_agent.py").write_text(VENV_MODULE)
    script = venv / "bin" / "agent"
    script.write_text(
        f"#!{venv}/bin/python\nimport sys, venv_agent\n"
        "print(venv_agent.ask(*sys.argv[1:4]), file=open('a.txt', 'w'))\n"
    )
    script.chmod(0o755)
    return script


@needs_isolation
def test_a_problem_names_its_own_harness_and_grade_timeout(tmp_path):
    """problem.harness (here a ``bash -c`` script running a harness from its own virtualenv) is run
    instead of the dispatcher's built-in harness, and recorded by its program; problem.grade_timeout_s
    bounds its grading (a check out of time fails)."""
    script = f'cd {{workspace}} && AGENT_MODE=1 {venv_agent(tmp_path)} {{base_url}} {{api_key}} "$(cat {{instruction_file}})"'
    own = Problem(**{**two_file_problem("own-harness").to_json(), "harness": ["bash", "-c", script]})
    hurried = Problem(**{**own.to_json(), "problem_id": "hurried", "grade_timeout_s": 0.001})
    with scripted_stack(str(tmp_path / "store"), lambda text: "alpha") as stack:
        outcomes = run(stack, [own, hurried], tmp_path)
        rows = {r["execution_id"]: r for r in Store(stack.store_config).read_table("executions").to_pylist()}
    by_problem = {o.problem_id: o for o in outcomes}
    assert (by_problem["own-harness"].status, by_problem["own-harness"].reward) == ("completed", 0.5)
    assert by_problem["own-harness"].calls == 1 and by_problem["own-harness"].turn_budget is None
    # the same workspace, graded within 1 ms: each check times out, a failed check
    assert (by_problem["hurried"].status, by_problem["hurried"].reward) == ("completed", 0.0)
    assert {rows[o.execution_id]["harness"] for o in outcomes} == {"agent"}


@needs_isolation
def test_a_harness_past_its_deadline_ends_with_everything_it_started(tmp_path):
    marker = f"gyre-test-{uuid.uuid4().hex[:8]}"
    hang = f"bash -c 'sleep 300; : {marker}'"  # its cmdline names the marker while it sleeps
    script = f"echo alpha > {{workspace}}/a.txt; setsid {hang} & ({hang} &); {hang}"
    with scripted_stack(str(tmp_path), lambda text: "unused") as stack:
        [outcome] = run(
            stack,
            [two_file_problem("hangs")],
            tmp_path,
            timeout_s=3.0,
            harness_command=["bash", "-c", script],
        )
    assert (outcome.status, outcome.reward, outcome.reward_source) == ("timeout", 0.5, "workspace_snapshot")
    assert processes_named(marker) == []
    assert quota_mounts(tmp_path / "ws") == []


def processes_named(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def test_a_workspace_whose_template_overflows_its_quota_leaves_no_mount(tmp_path):
    limits = SandboxLimits(disk_bytes=1 << 20, disk_files=100)
    with pytest.raises(OSError):
        Sandbox.create(tmp_path / "ws", "full", {"big.bin": "x" * (2 << 20)}, limits)
    assert quota_mounts(tmp_path / "ws") == []
