"""docs/own-model.md as a user follows it: every ``$ `` command of its console blocks runs, in order, with
the installed `gyre` in a fresh folder (the repo's configs/ beside it), and each output line the page
shows is in what the command printed ("..." stands for text that varies). The one change: `gyre run`
gets any free ports (--prefect-port 0 ...), so the test never collides with services already up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "own-model.md"
FREE_PORTS = " --prefect-port 0 --gateway-port 0 --engine-port 0"


def documented_commands(text: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown under it) of every console block, in page order."""
    found: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            if line.startswith("$ "):
                found.append((line[2:], []))
            elif line.strip():
                found[-1][1].append(line)
    return found


def test_the_page_documents_the_path_from_a_folder_to_a_campaign():
    commands = [command for command, _ in documented_commands(PAGE.read_text())]
    assert commands[0].startswith("gyre model init --family llama")
    assert any(c.startswith("gyre model check") for c in commands)
    assert any(c.startswith("gyre run") and "--policy" in c for c in commands)


def page_shell(folder: Path) -> Callable[[str], subprocess.CompletedProcess]:
    """Runs a command with bash in ``folder`` as a user of the installed `gyre` would (this
    interpreter's bin/ first on PATH, no Prefect settings of the test session)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT)

    def run(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=900
        )

    return run


def run_documented_commands(page: Path, run: Callable[[str], subprocess.CompletedProcess]) -> None:
    """Every command of the page's console blocks, in order: each exits 0 and prints what the page shows."""
    for command, shown in documented_commands(page.read_text()):
        if command.startswith("gyre run"):
            command += FREE_PORTS
        done = run(command)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        for line in shown:
            for piece in filter(None, (p.strip() for p in line.split("..."))):
                assert piece in done.stdout, f"{command}: {piece!r} not in\n{done.stdout[-2000:]}"


def follow_page(
    page: Path, folder: Path, stack_config: str, beside: tuple[str, ...] = ("configs",)
) -> Callable[[str], subprocess.CompletedProcess]:
    """Runs the page's commands in ``folder`` (run_documented_commands) with the repo's ``beside`` folders
    linked into it, then stops the stack they started (gyre down --config ``stack_config``) whatever
    happened; returns the shell, for checks after."""
    for name in beside:
        (folder / name).symlink_to(ROOT / name)
    run = page_shell(folder)
    try:
        run_documented_commands(page, run)
    finally:
        run(f"gyre down --config {stack_config}")
    return run


@pytest.mark.slow
def test_the_commands_of_the_own_model_page_run_as_documented(tmp_path):
    run = follow_page(PAGE, tmp_path, "configs/own-model.toml")
    published = tmp_path / "gyre-data" / "campaigns" / "own-model" / "policy" / "v1"
    check = run(f"gyre model check {published}")
    assert check.returncode == 0 and "tool calls llama3-json" in check.stdout, check.stderr
