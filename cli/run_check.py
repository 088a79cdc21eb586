"""`gyre run --check`: a campaign checked before anything starts; `gyre run` runs the same check first.

    gyre run --check --config my-tasks.toml

Nothing is started: no service, no Prefect run. The config is read (a typo names its key and the file:
flows/config.py), the policy folder is inspected as gyre will serve and train it
(engines/model/policy.py), and every suite is opened and split as the campaign will open it
(tasks/problems.py check_suites). Every error found is printed, not only the first, and the command
exits 1; warnings (a suite that is never evaluated) are printed and stop nothing.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flows.config import CampaignConfig
    from tasks.problems import CheckReport


def check_campaign(config: CampaignConfig, path: str) -> CheckReport:
    """The policy folder and every suite of ``config`` (read from ``path``), as the campaign will use them."""
    from engines.model.policy import PolicyError, inspect_policy
    from tasks.problems import check_suites

    check = check_suites(config.problems, config.evaluation)
    head = [f"config {path}: campaign {config.name}, {config.steps} step(s)"]
    if "://" in config.policy:
        head.append(f"policy {config.policy}: remote, checked by the services when they load it")
    else:
        try:
            info = inspect_policy(config.policy)
            head.append(f"policy {config.policy}: {info.architecture}, tool calls {info.tool_call_format}")
        except PolicyError as exc:
            check.errors.insert(0, str(exc))
    check.lines[:0] = head
    if check.held_out:
        every = config.evaluation.every
        when = f"at the start, every {every} steps and at the end" if every else "at the start and at the end"
        check.lines.append(
            f"evaluation: {check.held_out} held-out problem(s) x {config.evaluation.samples} sample(s), {when}"
        )
    return check


def say(check: CheckReport, path: str, *, every_line: bool) -> None:
    """Prints the check: with ``every_line`` what was checked too (`gyre run --check`), else only the
    warnings and errors (`gyre run`, before it starts); errors and warnings go to stderr."""
    if every_line:
        for line in check.lines:
            print(f"ok      {line}")
    for warning in check.warnings:
        print(f"warning {warning}", file=sys.stderr)
    for error in check.errors:
        print(f"error   {error}", file=sys.stderr)
    if check.errors:
        print(f"gyre run: {len(check.errors)} error(s) in {path}; nothing was started", file=sys.stderr)
    elif every_line:
        print(f"{path}: ready to run (gyre run --config {path})")
