"""`gyre suite check|list`: a problem suite checked problem by problem, and the suites installed.

    gyre suite check ./my-problems            # a folder of problem folders
    gyre suite check problems.jsonl           # a manifest (.jsonl or .parquet)
    gyre suite check mypkg.suites:hard        # a module:function plugin, or an installed suite's name
    gyre suite list                           # the built-in generators and the gyrerl.suites plugins

check prints one line per problem (ok, or what failed: malformed, the reference solution not scoring
1.0, the untouched workspace already scoring 1.0, a grader failing or not finishing in time) and a
summary; it exits 1 when anything failed (environments/suites/check.py).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from environments.suites import SuiteError, SuiteSpec, installed_suites
from environments.suites.spec import NAME_PATTERN


def add_suite_parser(commands) -> None:
    suite = commands.add_parser(
        "suite", help="problem suites: check one problem by problem, list the installed"
    )
    sub = suite.add_subparsers(dest="suite_command", required=True, metavar="SUBCOMMAND")
    check = sub.add_parser(
        "check",
        help="every problem: well formed, its reference solution scores 1.0, its untouched workspace "
        "less, its grader finishes in time",
    )
    check.add_argument(
        "suite", help="a folder of problem folders, a manifest (.jsonl, .parquet), module:function, or a name"
    )
    check.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds one grade may take, for a problem without grade_timeout_s",
    )
    check.add_argument(
        "--name", default=None, help="the suite's name, its problems' id prefix (default: from the path)"
    )
    sub.add_parser("list", help="the suites known by name: built-in generators and installed plugins")


def spec_of(target: str, name: str | None = None) -> SuiteSpec:
    """What the user named: a path (folder or manifest), a module:function, or a suite's name; a
    path that does not exist is refused as one (SuiteError), not taken for a suite's name."""
    if Path(target).exists():
        default = re.sub(r"[^A-Za-z0-9_]", "_", Path(target).stem) or "suite"
        return SuiteSpec(name=name or default, path=str(Path(target).resolve()))
    if ":" in target:
        return SuiteSpec(
            name=name or re.sub(r"[^A-Za-z0-9_]", "_", target.rpartition(":")[2]), entry_point=target
        )
    known = installed_suites()
    if target in known:
        return SuiteSpec(name=target)
    raise SuiteError(
        f"no such folder or file: {Path(target).absolute()}"
        + (f" (nor a suite of that name: {', '.join(sorted(known))})" if NAME_PATTERN.match(target) else "")
    )


def run_suite_command(args: argparse.Namespace) -> int:
    from environments.suites import check_suite

    if args.suite_command == "list":
        for name, target in sorted(installed_suites().items()):
            print(f"{name:<16} {target}")
        return 0
    failed = checked = 0
    for line in check_suite(spec_of(args.suite, args.name), timeout_s=args.timeout):
        print(line, flush=True)
        checked += 1
        failed += not line.ok
    print(f"{checked} problem(s) checked: {checked - failed} ok, {failed} failed")
    return 1 if failed or not checked else 0
