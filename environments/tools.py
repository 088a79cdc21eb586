"""The built-in harness's tools, defined once: their names, what they do and their arguments.

environments/harness.py turns them into OpenAI tool schemas; problem solutions
(environments/problems/problem.py) name them in their actions.
"""

from __future__ import annotations

TOOL_SPECS: dict[str, tuple[str, dict[str, str]]] = {
    "list_files": ("list the files under a folder of the workspace", {"path": "folder, '.' for all"}),
    "read_file": ("read a text file of the workspace", {"path": "relative path"}),
    "write_file": ("create or replace a text file", {"path": "relative path", "content": "the whole file"}),
    "run": ("run a shell command in the workspace", {"command": "a bash command"}),
    "run_tests": ("run the problem's visible tests", {}),
    "delegate": ("give a sub-task to a sub-agent with a fresh context", {"instruction": "the sub-task"}),
    "finish": ("end the work", {"summary": "what was done"}),
}
"""tool name -> (description, argument name -> description); every argument is a string."""
TOOL_NAMES: tuple[str, ...] = tuple(TOOL_SPECS)
