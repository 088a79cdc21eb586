"""`gyre bench schedule`: the three scheduling policies on the same simulated work (bench/schedule.py).

gyre bench schedule [--quick] [--preset paper-flagship|cpu-small|cpu-small-tail] [--out PATH]
"""

from __future__ import annotations

import argparse

DEFAULT_OUT = "bench/results/schedule.json"
PRESET_NAMES = ["paper-flagship", "cpu-small", "cpu-small-tail"]  # sim/presets.py PRESETS


def add_schedule_parser(bench_commands) -> None:
    schedule = bench_commands.add_parser(
        "schedule",
        help="scheduling in simulation: elastic vs colocate vs a tuned async split, against the bound",
    )
    schedule.add_argument("--quick", action="store_true", help="short campaigns (seconds)")
    schedule.add_argument("--preset", choices=PRESET_NAMES, default=None, help="one preset (default: all)")
    schedule.add_argument("--out", default=DEFAULT_OUT, help="where the figures go (JSON)")


def run(args: argparse.Namespace) -> int:
    from bench.schedule import main as bench_schedule  # numpy and the simulator: only when asked for

    return bench_schedule(quick=args.quick, out=args.out, preset=args.preset)
