"""docs/own-tasks.md as a user follows it: every file the page shows under a ``title="path"`` is written
to a fresh folder exactly as shown, then every ``$ `` command of its console blocks runs, in order,
with the installed `gyre` (the repo's data/ and configs/ beside it), and each output line the page
shows is in what the command printed ("..." stands for text that varies). The one change: `gyre run`
gets any free ports (--prefect-port 0 ...), so the test never collides with services already up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_docs_own_model import documented_commands, follow_page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "own-tasks.md"


def documented_files(text: str) -> dict[str, str]:
    """path -> content of every fenced block with a ``title="path"``, in page order."""
    blocks = re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', text, re.DOTALL)
    return dict(blocks)


def test_the_page_writes_three_problems_checks_them_and_trains_on_them_beside_a_built_in_suite():
    text = PAGE.read_text()
    files = documented_files(text)
    problems = {path.split("/")[1] for path in files if path.startswith("my-tasks/")}
    assert problems == {"slugify", "median", "word-count"}
    for name in problems:
        assert f"my-tasks/{name}/instruction.md" in files
        assert any(p.startswith(f"my-tasks/{name}/tests/") for p in files)
        assert any(p.startswith(f"my-tasks/{name}/solution/") for p in files)
    config = files["my-tasks.toml"]
    assert 'path = "my-tasks"' in config and '"terminal"' in config and "held_out" in config
    commands = [command for command, _ in documented_commands(text)]
    assert commands[0] == "gyre suite check my-tasks"
    assert any(c.startswith("gyre run --config my-tasks.toml") for c in commands)
    assert any(c.startswith("gyre sql") for c in commands)


@pytest.mark.slow
def test_the_commands_of_the_own_tasks_page_run_as_documented(tmp_path):
    for rel, content in documented_files(PAGE.read_text()).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(content)
    follow_page(PAGE, tmp_path, "my-tasks.toml", beside=("data", "configs"))
    # the held-out problem was evaluated, never trained on, and the split is on record
    record = json.loads((tmp_path / "gyre-data" / "campaigns" / "my-tasks" / "suites.json").read_text())
    mine = next(suite for suite in record["suites"] if suite["name"] == "mine")
    assert list(mine["held_out"]) == ["mine-median"]
    assert sorted(mine["train"]) == ["mine-slugify", "mine-word-count"]
