"""`gyre bench schedule`: the three scheduling policies on the same simulated work (bench/schedule.py).

gyre bench schedule [--quick] [--sim-only] [--preset paper-flagship|cpu-small|cpu-small-tail] [--out PATH]
"""

from __future__ import annotations

import argparse

DEFAULT_OUT = "bench/results/schedule.json"
PRESET_NAMES = ["paper-flagship", "cpu-small", "cpu-small-tail"]  # sim/presets.py PRESETS


def add_schedule_parser(bench_commands) -> None:
    schedule = bench_commands.add_parser(
        "schedule",
        help="scheduling: elastic vs colocate vs a tuned async split, simulated at paper scale and run "
        "for real on this machine's CPU",
    )
    schedule.add_argument("--quick", action="store_true", help="short campaigns, short real runs")
    schedule.add_argument("--sim-only", action="store_true", help="simulation alone (no real runs)")
    schedule.add_argument("--preset", choices=PRESET_NAMES, default=None, help="one preset (default: all)")
    schedule.add_argument("--out", default=DEFAULT_OUT, help="where the figures go (JSON)")


def run(args: argparse.Namespace) -> int:
    from bench.schedule import main as bench_schedule  # numpy and the simulator: only when asked for

    return bench_schedule(quick=args.quick, out=args.out, preset=args.preset, real=not args.sim_only)


def add_sim_parser(commands) -> None:
    sim = commands.add_parser(
        "sim",
        help="one simulated campaign per policy (elastic, colocate, the best async split) on the same work",
    )
    sim.add_argument("--preset", choices=PRESET_NAMES, default="paper-flagship", help="the modelled campaign")
    sim.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change the preset: steps=8, cluster.cells=512, engine.sessions_per_cell=4, "
        "trainer.tokens_per_s=8000, to_train_s=20, elastic.min_dwell_s=300 (repeatable)",
    )
    sim.add_argument("--out", default=None, help="also write the figures here (JSON)")
    sim.add_argument(
        "--suites-from",
        default=None,
        metavar="CAMPAIGN",
        help="fit the preset's suites (turns, tokens per turn, tool gaps) on this campaign's recorded "
        "executions (sim/recorded.py), before any --set",
    )
    sim.add_argument("--data-root", default="./gyre-data", help="the store holding --suites-from's campaign")


def run_sim(args: argparse.Namespace) -> int:
    import json

    from bench.schedule import print_preset, run_preset
    from sim.presets import PRESETS, with_settings

    preset = PRESETS[args.preset]
    if args.suites_from:
        import dataclasses

        preset = dataclasses.replace(preset, suites=recorded_suites(args.data_root, args.suites_from))
    preset = with_settings(preset, args.settings)
    figures = run_preset(preset)
    print_preset(preset.name, figures)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(figures, handle, indent=1)
    return 0


def recorded_suites(data_root: str, campaign: str):
    """The suites of a campaign's recorded executions (one per harness), fitted by sim/recorded.py."""
    from sim.recorded import RecordedCall, RecordedExecution, suites_from_executions
    from trajectory_store.db import connect
    from trajectory_store.storage import Store, StoreConfig

    con = connect(Store(StoreConfig(data_root=data_root, campaign=campaign)))
    rows = con.execute(
        """
        SELECT e.harness, e.ended_at,
               list(struct_pack(p := c.prompt_len, o := c.output_len, s := c.t_start, t := c.t_end)
                    ORDER BY c.call_id)
        FROM executions e JOIN calls c USING (execution_id)
        WHERE e.status <> 'abandoned' AND c.t_start IS NOT NULL AND c.t_end IS NOT NULL
        GROUP BY e.execution_id, e.harness, e.ended_at
        """
    ).fetchall()
    con.close()
    return suites_from_executions(
        [
            RecordedExecution(
                harness or "recorded",
                [RecordedCall(c["p"] or 0, c["o"] or 0, c["s"], c["t"]) for c in calls],
                ended_at,
            )
            for harness, ended_at, calls in rows
        ]
    )
