"""The `gyre` command line (installed as .venv/bin/gyre; `gyre COMMAND --help` lists every option).

    gyre run [--config configs/demo.toml]              up + the demo campaign (RL from the warm start) + summary
    gyre run --check [--config C]                      only check the config, the policy and every suite (starts nothing)
    gyre up | status | down                            the services on loopback: Prefect server + UI, engines, gateway
    gyre deploy [--file deployments/prefect.yaml]      register the scheduled campaigns; gyre worker runs them
    gyre traj demo [--config configs/demo.toml]        the store demo flow (sample trace -> trees -> packed batch)
    gyre traj import FILE.jsonl [--step N]             JSONL interchange -> delta-encoded Parquet
    gyre traj export OUT.jsonl                         the store -> JSONL (full prompts, exact)
    gyre traj stats [--format table|json]              per-execution figures
    gyre traj check [--quarantine]                     read every part; move unreadable ones aside
    gyre traj sample OUT.jsonl [--preset sample]       write a synthetic paper-shaped trace
    gyre sql [--format table|csv|json] "SQL"           query the views (read-only: queries only)
    gyre snapshot export|restore EXECUTION_ID OUT      an execution's workspace snapshot as a tar.gz or a folder
    gyre suite check PATH | gyre suite list            a problem suite checked problem by problem; the suites known
    gyre rollout --suite terminal --n 4 (--gateway URL | --model DIR)
                                                       agent executions: dispatched, graded, recorded
    gyre execution register [--problem-id P]           register one execution (an external harness):
                                                       prints its base_url and api_key
    gyre execution finish ID --status S --reward R     finish it: the gateway records it with its calls
    gyre model init --preset tiny --out URL [--seed N]  a random-init policy model + tokenizer (HF format)
                    [--family qwen2|qwen3|llama|mistral]
    gyre model check DIR                               a Hugging Face folder as a policy: what gyre reads, or why not
    gyre model sft --model DIR --out DIR               supervised warm start, held-out pass rate before/after
    gyre model eval --model DIR                        held-out pass rate and mean reward of a policy
    gyre gateway --model DIR --engine URL [...]        the OpenAI-compatible gateway in front of rollout engines
    gyre engine --model DIR [--port 8100]              one rollout engine's token-id server
    gyre bench store|train|engine|rollout|learn [--quick]  the benchmarks (figures printed and in bench/results/)
    gyre bench ui [--out bench/results/ui.png]         a screenshot of a campaign in the Prefect UI
    gyre bench schedule [--quick] [--sim-only]         elastic vs colocate vs async: simulated at paper scale + real on CPU
    gyre bench exploits [--graders KINDS]              every known exploit against every folder grader (reward integrity)
    gyre bench faults [--quick] [--only PARTS]         processes killed, misbehaving agents, gateway load: lost / duplicated work
    gyre bench hosts [--quick]                         beyond one machine: KV over TCP, training, a campaign across hosts
    gyre bench placement                               cells on hosts: Prefect work pools against prefect-ray (make ray)
    gyre bench xlong [--quick]                         one execution touching up to 1M tokens: time and memory per stage
    gyre sim [--preset NAME] [--set KEY=VALUE ...]     one simulated comparison of the three policies, against the bound

Every store command takes --data-root URL (default $GYRE_DATA_ROOT or ./gyre-data; s3://bucket/prefix
works, with the standard AWS variables or --s3-endpoint-url) and --campaign NAME (default
$GYRE_CAMPAIGN or default). `gyre gateway` and `gyre engine` take exactly the options of
`python -m engines.gateway` and `python -m engines.rollout.server` (generated from their config
classes). cli/settings.py names the environment variables read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cli import agents, campaign, executions, schedule, settings, snapshot, suite
from cli.format import render
from cli.model import add_model_parsers, run_model_command
from engines.gateway import settings as gateway_settings
from engines.rollout import settings as engine_settings

if TYPE_CHECKING:
    from flows.demo import DemoSummary
    from tasks.trajectory import CheckSummary
    from trajectory_store.storage import StoreConfig

VIEWS_HELP = (
    "views: executions, calls, call_prompts, tree_nodes, trajectories, selected_trajectories, training_nodes, "
    "training_tokens, execution_stats, metrics, snapshots, snapshot_files, snapshot_changes, blobs"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gyre",
        description="gyrerl: elastic RL for xLong-horizon agents. Trajectories as Parquet, trees in DuckDB.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    traj = commands.add_parser("traj", help="import, export and summarize trajectories")
    traj_commands = traj.add_subparsers(dest="traj_command", required=True, metavar="SUBCOMMAND")
    demo = traj_commands.add_parser(
        "demo", help="the store demo flow: import the sample trace, trees, select, pack (no model)"
    )
    demo.add_argument("--config", default="configs/demo.toml", help="campaign config (TOML)")
    demo.add_argument("--data-root", default=None, help="override [store].data_root")
    demo.add_argument("--trace", default=None, help="JSONL trace to import (default: the bundled sample)")
    imp = traj_commands.add_parser("import", help="import a JSONL trace (full prompt ids per call)")
    imp.add_argument("file", help="the JSONL trace (one record per line: executions and calls)")
    settings.add_store_options(imp)
    imp.add_argument(
        "--step", type=int, default=None, help="store as this step (default: each record's step, or 0)"
    )
    exp = traj_commands.add_parser("export", help="export the campaign as JSONL with full prompts")
    settings.add_store_options(exp)
    exp.add_argument("out", help="the JSONL file to write")
    stats = traj_commands.add_parser("stats", help="per-execution token, tree and storage figures")
    settings.add_store_options(stats)
    stats.add_argument("--format", choices=["table", "json"], default="table", help="output format")
    check = traj_commands.add_parser(
        "check", help="read every part whole; list the unreadable ones (--quarantine moves them aside)"
    )
    settings.add_store_options(check)
    check.add_argument(
        "--quarantine",
        action="store_true",
        help="move unreadable parts under <campaign>/quarantine/parts/ (never deleted) so the rest is queryable",
    )
    sample = traj_commands.add_parser("sample", help="write a synthetic, paper-shaped trace as JSONL")
    sample.add_argument("out", help="the JSONL file to write")
    sample.add_argument(
        "--preset",
        choices=["sample", "quick", "full"],
        default="sample",
        help="sample: the bundled 4-execution trace; quick and full: the storage benchmark's workloads",
    )

    sql = commands.add_parser(
        "sql",
        help="run read-only SQL over the trajectory views",
        epilog=VIEWS_HELP
        + ". Read-only: queries only (no COPY, ATTACH, INSTALL, CREATE, SET; no other files).",
    )
    settings.add_store_options(sql)
    sql.add_argument("--format", choices=["table", "csv", "json"], default="table", help="output format")
    sql.add_argument("query", help="one SQL query over the views below")

    bench = commands.add_parser("bench", help="benchmarks (print figures, write bench/results/*.json)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    store_bench = bench_commands.add_parser("store", help="storage: bytes per unique token, import, trees")
    store_bench.add_argument("--quick", action="store_true", help="a small workload (under a minute)")
    store_bench.add_argument("--out", default="bench/results/store.json", help="where the figures go (JSON)")
    train_bench = bench_commands.add_parser(
        "train", help="training: tree-packed vs per-path, elastic satellites"
    )
    train_bench.add_argument("--quick", action="store_true", help="the tiny model (under two minutes)")
    train_bench.add_argument("--out", default="bench/results/train.json", help="where the figures go (JSON)")
    engine_bench = bench_commands.add_parser(
        "engine", help="rollout: engine vs HF generate, KV migration vs recompute, gateway overhead"
    )
    engine_bench.add_argument(
        "--quick", action="store_true", help="the tiny model, 2K/8K (about two minutes)"
    )
    engine_bench.add_argument(
        "--out", default=None, help="where the figures go (JSON; engine.json, or engines.json with --engines)"
    )
    engine_bench.add_argument(
        "--engines",
        default=None,
        help="compare rollout engines as campaigns run them, e.g. gyre,vllm: throughput at concurrency 8, "
        "TTFT, prefix-cache hits, moving a session (bench/engines_compare.py)",
    )

    gateway = commands.add_parser(
        "gateway",
        help="run the OpenAI-compatible gateway in front of rollout engines (records every call)",
        description="The same options as python -m engines.gateway (GatewayConfig's fields).",
    )
    gateway_settings.add_arguments(gateway)
    engine = commands.add_parser(
        "engine",
        help="run one rollout engine (token-id completions + KV admin)",
        description="The same options as python -m engines.rollout.server (EngineServerConfig's fields).",
    )
    engine_settings.add_arguments(engine)

    model = commands.add_parser(
        "model", help="policy models: init (HF format, any fsspec URL), sft (warm start), eval"
    )
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    add_model_parsers(model_commands)
    agents.add_sft_parser(model_commands)
    agents.add_eval_parser(model_commands)
    agents.add_rollout_parser(commands)
    executions.add_execution_parser(commands)
    snapshot.add_snapshot_parser(commands)
    suite.add_suite_parser(commands)
    agents.add_bench_parser(bench_commands)
    campaign.add_campaign_parsers(commands, bench_commands)
    schedule.add_schedule_parser(bench_commands)
    exploits = bench_commands.add_parser(
        "exploits",
        help="reward integrity: every known exploit against every folder grader, final and snapshot",
    )
    exploits.add_argument("--graders", default="pytest,checks,junit,json,exit_code", help="grader kinds")
    exploits.add_argument("--only", nargs="*", default=[], help="exploits whose name contains one of these")
    exploits.add_argument("--out", default="bench/results/exploits.json", help="where the figures go (JSON)")
    hosts_bench = bench_commands.add_parser(
        "hosts",
        help="beyond one machine (network namespaces): KV over TCP vs re-prefill, training across hosts, a campaign "
        "on 1 host vs 3 and with one cut off",
    )
    hosts_bench.add_argument(
        "--quick",
        action="store_true",
        help="8K tokens only, one round; the campaign only with a host cut off and with a gateway killed",
    )
    hosts_bench.add_argument("--out", default="bench/results/hosts.json", help="where the figures go (JSON)")
    placement_bench = bench_commands.add_parser(
        "placement",
        help="placing cells on hosts: Prefect work pools against prefect-ray, on the same test hosts (make ray)",
    )
    placement_bench.add_argument(
        "--out", default="bench/results/placement.json", help="where the figures go (JSON)"
    )
    xlong_bench = bench_commands.add_parser(
        "xlong", help="one execution touching up to 1M tokens, end to end: time and peak memory per stage"
    )
    xlong_bench.add_argument("--quick", action="store_true", help="64K and 256K tokens touched (no 1M)")
    xlong_bench.add_argument(
        "--sizes", default="", help="tokens touched, comma-separated (default 64K,256K,1M)"
    )
    xlong_bench.add_argument("--out", default="bench/results/xlong.json", help="where the figures go (JSON)")
    xlong_bench.add_argument(
        "--only", default="", help="'snapshot': that stage alone for every size of --out, its rows replaced"
    )
    faults = bench_commands.add_parser(
        "faults", help="faults and load on real processes: lost and duplicated work, recovery seconds"
    )
    faults.add_argument(
        "--quick",
        action="store_true",
        help="one run of each fault, a 200-execution step, 64 sessions of load for 20 s",
    )
    faults.add_argument("--out", default="bench/results/faults.json", help="where the figures go (JSON)")
    faults.add_argument(
        "--only",
        default="",
        help="comma-separated parts to run (processes, s3, big, load, campaign, satellite); their rows replace the "
        "same rows of --out, the others are kept",
    )
    schedule.add_sim_parser(commands)
    _show_defaults(parser)
    return parser


class _DefaultsFormatter(argparse.HelpFormatter):
    """Ends an option's help with its default, unless the help already names it (options generated
    from a config class do), the option is a flag or required, or it has no default (SUPPRESS)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.nargs == 0
            or action.required
            or action.default is argparse.SUPPRESS
            or "default" in text
        ):
            return text
        shown = "none" if action.default is None else str(action.default).replace("%", "%%")
        return f"{text} (default: {shown})"


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.formatter_class = _DefaultsFormatter
                _show_defaults(subparser)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        settings.quiet_prefect()  # and Prefect is configured once its check passed: a refused run
    elif args.command != "suite":  # leaves nothing behind, not even the data root (cli/campaign.py)
        settings.configure_prefect(settings.data_root_of(args))
    try:
        return _dispatch(args)
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"gyre: error: {error}", file=sys.stderr)
        return 2


CAMPAIGN_COMMANDS = {"run", "up", "status", "down", "deploy", "worker"}


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in CAMPAIGN_COMMANDS or getattr(args, "bench_command", None) in ("learn", "ui"):
        return campaign.run_campaign_command(args)
    if args.command == "traj" and args.traj_command == "demo":
        return _store_demo(args)
    if args.command == "bench" and args.bench_command == "store":
        from bench.store import main as bench_store

        return bench_store(quick=args.quick, out=args.out)
    if args.command == "bench" and args.bench_command == "exploits":
        from bench.exploits import main as bench_exploits

        return bench_exploits(["--graders", args.graders, "--out", args.out, "--only", *args.only])
    if args.command == "bench" and args.bench_command == "faults":
        from bench.faults import main as bench_faults

        only = tuple(part for part in args.only.split(",") if part)
        return bench_faults(quick=args.quick, out=args.out, only=only)
    if args.command == "bench" and args.bench_command == "schedule":
        return schedule.run(args)
    if args.command == "bench" and args.bench_command == "hosts":
        from bench.hosts import main as bench_hosts

        return bench_hosts(quick=args.quick, out=args.out)
    if args.command == "bench" and args.bench_command == "placement":
        from bench.placement import main as bench_placement

        return bench_placement(out=args.out)
    if args.command == "bench" and args.bench_command == "xlong":
        from bench.xlong import main as bench_xlong

        sizes = [int(size) for size in args.sizes.split(",") if size]
        return bench_xlong(quick=args.quick, out=args.out, sizes=sizes or None, only=args.only)
    if args.command == "sim":
        return schedule.run_sim(args)
    if args.command == "bench" and args.bench_command == "train":
        from bench.train import main as bench_train

        return bench_train(quick=args.quick, out=args.out)
    if args.command == "bench" and args.bench_command == "engine":
        if args.engines:
            from bench.engines_compare import main as compare_engines

            return compare_engines(
                args.engines, quick=args.quick, out=args.out or "bench/results/engines.json"
            )
        from bench.engine import main as bench_engine

        return bench_engine(quick=args.quick, out=args.out or "bench/results/engine.json")
    if args.command == "bench" and args.bench_command == "rollout":
        from bench.rollout import main as bench_rollout

        return bench_rollout(quick=args.quick, out=args.out, model=args.model)
    if args.command == "rollout":
        return agents.run_rollout_command(args)
    if args.command == "execution":
        return executions.run_execution_command(args)
    if args.command == "snapshot":
        return snapshot.run_snapshot_command(args)
    if args.command == "suite":
        return suite.run_suite_command(args)
    if args.command == "model" and args.model_command == "sft":
        return agents.run_sft_command(args)
    if args.command == "model" and args.model_command == "eval":
        return agents.run_eval_command(args)
    if args.command == "gateway":
        from stack.serve import serve_gateway

        serve_gateway(gateway_settings.config_from_args(args))
        return 0
    if args.command == "engine":
        from stack.serve import serve_engine

        serve_engine(engine_settings.config_from_args(args))
        return 0
    if args.command == "traj" and args.traj_command == "sample":
        from tasks.trajectory import write_synthetic_trace

        lines = write_synthetic_trace.fn(args.preset, args.out)
        print(f"wrote {lines} records ({args.preset} preset) to {args.out}")
        return 0
    if args.command == "model":
        return run_model_command(args)

    from tasks import trajectory as t

    store = settings.store_config(args)
    if args.command == "sql":
        import duckdb

        try:
            result = t.run_sql.fn(store, t.SelectionConfig(), args.query)
        except duckdb.Error as error:
            print(f"gyre: SQL error: {error}", file=sys.stderr)
            if isinstance(error, duckdb.PermissionException):
                print(
                    "gyre: gyre sql is read-only: it reads the campaign's views and no other file",
                    file=sys.stderr,
                )
            print(f"gyre: {VIEWS_HELP}", file=sys.stderr)
            return 2
        print(render(result.columns, result.rows, args.format))
        return 0
    if args.traj_command == "import":
        summary = t.import_trace.fn(args.file, store, args.step)
        print(
            f"imported {summary.executions} executions, {summary.calls} calls into {store.data_root} "
            f"(campaign {store.campaign}): {summary.naive_tokens} tokens as sent, {summary.unique_tokens} unique"
            + (f" ({summary.naive_tokens / summary.unique_tokens:.1f}x)" if summary.unique_tokens else "")
            + (f"; {summary.unchanged} record(s) were already stored, unchanged" if summary.unchanged else "")
        )
        if summary.quarantined:
            for error in summary.errors:
                print(f"gyre: error: {error}", file=sys.stderr)
            print(
                f"gyre: {summary.quarantined} record(s) quarantined under quarantine/ with the reason; "
                "every valid record was imported",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.traj_command == "export":
        counts = t.export_trace.fn(store, args.out)
        print(f"exported {counts['executions']} executions, {counts['calls']} calls to {args.out}")
        return 0
    if args.traj_command == "check":
        return _check(t.check_store.fn(store, args.quarantine))
    if args.traj_command == "stats":
        result = t.execution_stats.fn(store, t.SelectionConfig())
        if args.format == "json":
            print(json.dumps([dict(zip(result.columns, row, strict=True)) for row in result.rows], indent=1))
        else:
            print(render(result.columns, result.rows))
        if not result.rows:
            print(f"gyre: {_empty_campaign_hint(store)}", file=sys.stderr)
        return 0
    raise ValueError(f"unknown command {args.command!r}")


def _empty_campaign_hint(config: StoreConfig) -> str:
    """Names the campaigns that do exist under the data root (`make run` writes campaign demo)."""
    from trajectory_store.storage import Store

    store = Store(config)
    try:
        found = store.fs.ls(f"{store.root}/campaigns", detail=False)
    except FileNotFoundError:
        found = []
    names = sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in found)
    others = [name for name in names if name != config.campaign]
    head = f"campaign {config.campaign!r} under {config.data_root} holds no executions"
    if not others:
        return f"{head}, and no other campaign is there"
    return f"{head}; campaigns there: {', '.join(others)} (give --campaign {others[0]} or set GYRE_CAMPAIGN)"


def _check(summary: CheckSummary) -> int:
    """Prints one line per unreadable part and one summing up; 0 when every part reads (or moved)."""
    total = sum(summary.parts.values())
    for problem in summary.problems:
        line = f"{problem.url}: unreadable {problem.kind} part: {problem.reason}"
        if problem.part in summary.quarantined:
            line += f" -> moved to {summary.quarantined[problem.part] or '(nothing: it was missing)'}"
        print(line)
    if not summary.problems:
        print("every part reads whole (" + ", ".join(f"{k} {n}" for k, n in summary.parts.items()) + ")")
        return 0
    if summary.quarantined:
        print(
            f"{len(summary.quarantined)} of {total} parts quarantined under quarantine/parts/ (kept, with the reason); "
            "the rest is queryable"
        )
        return 0 if len(summary.quarantined) == len(summary.problems) else 1
    print(
        f"{len(summary.problems)} of {total} parts unreadable; `gyre traj check --quarantine` moves them under "
        "quarantine/parts/ so the rest is queryable",
        file=sys.stderr,
    )
    return 1


def _store_demo(args: argparse.Namespace) -> int:
    from flows.config import CampaignConfig
    from flows.demo import store_demo

    config = CampaignConfig.from_toml(args.config)
    if args.data_root:
        config.store.data_root = args.data_root
    if args.trace:
        config.trace = args.trace
    print_demo(store_demo(config))
    return 0


def print_demo(summary: DemoSummary) -> None:
    """The demo flow's results: what was imported, the trees, the selection, the packed step, the stats."""
    imported, trees, selection, packed = summary.imported, summary.trees, summary.selection, summary.packed
    print(
        f"imported {imported.executions} executions and {imported.calls} calls from {imported.path}: "
        f"{imported.naive_tokens} tokens as sent, {trees.unique_tokens} unique "
        f"({imported.naive_tokens / max(trees.unique_tokens, 1):.1f}x), {imported.quarantined} quarantined"
    )
    print(
        f"trees: {trees.tree_nodes} nodes, {trees.policy_tokens} policy tokens, {trees.trajectories} trajectories; "
        f"{trees.prompts_verified} prompts rebuilt and verified against context_hash"
    )
    print(
        f"selected {selection.selected} trajectories {selection.by_role}, {selection.training_tokens} training tokens"
    )
    print(
        f"packed step 0: {packed.sequences} sequences, {packed.tokens} tokens ({packed.target_tokens} targets, "
        f"{packed.repeated_tokens} repeated ancestors) -> {packed.uri}"
    )
    print("\nper execution:\n" + render(summary.stats.columns, summary.stats.rows))
    for title, result in summary.examples.items():
        print(f"\n{title}:\n" + render(result.columns, result.rows))


if __name__ == "__main__":
    sys.exit(main())
