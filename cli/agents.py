"""The agent commands of `gyre`: rollout, model sft|eval and bench rollout (parsers and handlers).

gyre rollout --suite swe --n 4 --timeout 60 --gateway http://127.0.0.1:8200 --admin-token T
gyre rollout --suite terminal --n 4 --model ./models/tiny        # starts engine + gateway itself
    (one row per execution as it finishes, a summary, and "recorded to <data root> (campaign, step)";
    execution ids end in a fresh run id, so running it again never collides with the first run)
gyre model sft --model ./models/tiny --out ./models/tiny-sft
gyre model eval --model ./models/tiny-sft
gyre bench rollout --quick
"""

from __future__ import annotations

import argparse
import json
import secrets
import shlex
import sys
from dataclasses import asdict

from cli import settings
from cli.executions import add_gateway_options, admin_token_for, call_gateway, gateway_of, recorded_line
from cli.format import Rows, render

SUITES = ["repo", "swe", "terminal", "mixed", "folder"]
"""The names --suite always knows; an installed suite's name (gyre suite list) or module:function works too."""


def add_rollout_parser(commands) -> None:
    rollout = commands.add_parser(
        "rollout", help="run agent executions against a gateway and print status and reward of each"
    )
    rollout.add_argument(
        "--suite",
        required=True,
        help=f"{', '.join(SUITES)} (generated problems, mixed: all three; folder: --problems), an installed "
        "suite's name (gyre suite list) or module:function",
    )
    rollout.add_argument("--n", type=int, default=4, help="problems (each runs --group-size times)")
    rollout.add_argument("--timeout", type=float, default=120.0, help="deadline of one execution, seconds")
    rollout.add_argument(
        "--problems",
        default=None,
        help="folder of problem folders, or a manifest (.jsonl, .parquet), with --suite folder",
    )
    rollout.add_argument("--seed", type=int, default=0, help="seed of the generated problems")
    rollout.add_argument("--difficulty", type=int, default=1, help="difficulty of the generated problems")
    rollout.add_argument(
        "--length",
        type=int,
        default=1,
        help="how much text each item of a generated problem carries (lines, expression size)",
    )
    rollout.add_argument("--group-size", type=int, default=1, help="executions per problem (one GRPO group)")
    rollout.add_argument("--concurrency", type=int, default=4, help="executions running at once")
    rollout.add_argument("--turns", type=int, default=4, help="turn budget of a short execution")
    rollout.add_argument("--long-fraction", type=float, default=0.2, help="executions with 10-50x the turns")
    rollout.add_argument("--step", type=int, default=0, help="the step the executions are recorded at")
    rollout.add_argument(
        "--snapshot-completed",
        action="store_true",
        help="store completed executions' final workspaces too (timeouts are always snapshotted)",
    )
    rollout.add_argument(
        "--run-id",
        default=None,
        help="appended to every execution id (s0-<problem>-g0-<run id>); default: a fresh one per run, so "
        "a second run never collides with the first; '' for none (then a rerun at the same step is refused)",
    )
    add_gateway_options(rollout, alternative="; or --model")
    rollout.add_argument("--model", default=None, help="no gateway: start an engine + gateway on this model")
    rollout.add_argument(
        "--harness-command",
        default=None,
        help="an external harness, e.g. 'python my_agent.py --base-url {base_url} --api-key {api_key} "
        "--workspace {workspace}' ({instruction_file} is the instruction's path)",
    )
    settings.add_store_options(rollout, skip={"vocab_size"})
    rollout.add_argument("--format", choices=["table", "json"], default="table", help="output format")


def add_sft_parser(model_commands) -> None:
    sft = model_commands.add_parser(
        "sft", help="supervised warm start on generated demonstrations, with held-out pass rate before/after"
    )
    sft.add_argument("--model", required=True, help="HF folder of the policy to start from")
    sft.add_argument("--out", required=True, help="folder for the fine-tuned policy")
    sft.add_argument("--suites", default="terminal,repo,swe", help="comma-separated suites")
    sft.add_argument(
        "--train-problems",
        type=int,
        default=240,
        help="generated demonstrations, split evenly across the suites",
    )
    sft.add_argument("--eval-problems", type=int, default=8, help="held-out problems per suite")
    sft.add_argument("--steps", type=int, default=300, help="optimizer steps on the demonstrations")
    sft.add_argument("--batch-size", type=int, default=8, help="demonstrations per step")
    sft.add_argument("--lr", type=float, default=2e-3, help="learning rate")
    sft.add_argument(
        "--copy-steps",
        type=int,
        default=1000,
        help="steps of copy drills first: a random-init policy cannot copy names from the instruction "
        "(0 for a pretrained policy)",
    )
    sft.add_argument("--difficulty", type=int, default=1, help="difficulty of the generated problems")
    sft.add_argument(
        "--recovery-share",
        type=float,
        default=0.0,
        help="share of the problems with visible tests demonstrated with a failed first attempt (the file "
        "written back unchanged, the tests failing) before the fix; the mistake itself is not trained on",
    )
    sft.add_argument(
        "--give-up-share",
        type=float,
        default=0.0,
        help="share of the other demonstrations that call finish at once, nothing done (a warm start "
        "that gives up at about that rate: a failure RL can unlearn; configs/learn-give-up.toml)",
    )
    sft.add_argument(
        "--seed",
        type=int,
        default=0,
        help="demonstrations come from generator seeds 1000 + 10 * seed + suite index (and the shuffle)",
    )
    sft.add_argument(
        "--eval-seed",
        type=int,
        default=0,
        help="generator seed of the before/after problems (0: the campaigns' held-out set; 20000: validation)",
    )
    sft.add_argument("--no-eval", action="store_true", help="skip the before/after evaluation")
    sft.add_argument("--report", default=None, help="also write the report as JSON here")


def add_eval_parser(model_commands) -> None:
    evaluate = model_commands.add_parser(
        "eval", help="held-out pass rate and mean reward of a policy (engine + gateway + harness + graders)"
    )
    evaluate.add_argument("--model", required=True, help="HF folder of the policy")
    evaluate.add_argument("--suites", default="terminal,repo,swe", help="comma-separated suites")
    evaluate.add_argument("--problems", type=int, default=8, help="held-out problems per suite")
    evaluate.add_argument("--difficulty", type=int, default=1, help="difficulty of the generated problems")
    evaluate.add_argument("--seed", type=int, default=0, help="problem seed (SFT trains on seeds >= 1000)")


def run_eval_command(args: argparse.Namespace) -> int:
    from tasks.sft import evaluate_policy

    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    result = evaluate_policy(args.model, suites, args.problems, seed=args.seed, difficulty=args.difficulty)
    columns = ["suite", "pass_rate", "mean_reward", "executions", "calls", "branches"]
    rows = [[suite, *(result[suite][c] for c in columns[1:])] for suite in [*suites, "overall"]]
    print(render(columns, rows))
    return 0


def add_bench_parser(bench_commands) -> None:
    bench = bench_commands.add_parser(
        "rollout", help="agent executions: throughput, trees, timeouts graded, sandbox refusals"
    )
    bench.add_argument("--quick", action="store_true", help="a small run (a few minutes)")
    bench.add_argument("--model", default=None, help="policy folder (default: a fresh tiny model)")
    bench.add_argument("--out", default="bench/results/rollout.json", help="where the figures go (JSON)")


OUTCOME_COLUMNS = [
    ("execution", 40),
    ("status", 11),
    ("reward", -6),
    ("reward_source", 18),
    ("calls", -5),
    ("branches", -8),
]  # (name, width; negative: right-aligned)


def outcome_values(outcome) -> list[str]:
    reward = "-" if outcome.reward is None else f"{outcome.reward:.2f}"
    return [
        outcome.execution_id,
        outcome.status,
        reward,
        outcome.reward_source or "-",
        str(outcome.calls),
        str(outcome.branches),
    ]


def run_rollout_command(args: argparse.Namespace) -> int:
    """Dispatches the executions, printing one row per execution as it finishes (on stderr with
    --format json), then the summary and where the gateway recorded them."""
    import contextlib

    from tasks.rollout import (
        DispatchConfig,
        DurationProfile,
        GatewayAdminError,
        choose_problems,
        run_rollout,
        summarize_outcomes,
    )

    store = settings.store_config(args)
    problems = choose_problems(
        args.suite,
        args.n,
        seed=args.seed,
        difficulty=args.difficulty,
        length=args.length,
        folder=args.problems,
    )
    run_id = f"r{secrets.token_hex(3)}" if args.run_id is None else (args.run_id or None)
    config = DispatchConfig(
        step=args.step,
        group_size=args.group_size,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        durations=DurationProfile(short_turns=args.turns, long_fraction=args.long_fraction),
        harness_command=shlex.split(args.harness_command) if args.harness_command else None,
        run_id=run_id,
        snapshot_completed=args.snapshot_completed,
    )
    progress = sys.stderr if args.format == "json" else sys.stdout
    gateway, token = gateway_of(args)
    with contextlib.ExitStack() as stack:
        if gateway:
            token = admin_token_for(gateway, token)
        elif args.model:
            from stack.stack import local_stack

            local = stack.enter_context(local_stack(args.model, store, step=args.step))
            gateway, token = local.gateway_url, local.admin_token
        else:
            raise ValueError("give --gateway URL (a running gateway) or --model DIR (start one here)")
        rows = Rows(OUTCOME_COLUMNS, file=progress)
        rows.header()
        try:
            outcomes = run_rollout(
                problems,
                gateway,
                token,
                store,
                config,
                on_outcome=lambda o: rows.add(outcome_values(o), o.error or ""),
            )
        except GatewayAdminError as exc:
            if exc.status != 409:
                raise ValueError(str(exc)) from None
            raise ValueError(
                f"{exc}. An execution of this run is already finished on the gateway: give another "
                "--run-id, or leave --run-id out (each run gets a fresh one)"
            ) from None
        where = recorded_line(call_gateway(gateway, token, lambda admin: admin.stats()), args.step)
    summary = summarize_outcomes(outcomes)
    print(
        f"{summary['executions']} executions: {summary['by_status']}, mean reward {summary['mean_reward']:.3f}, "
        f"pass rate {summary['pass_rate']:.2f}, {summary['timeouts_graded']} timeouts graded from snapshots",
        file=progress,
    )
    print(f"{where}; run id {run_id or '(none)'}", file=progress)
    if args.format == "json":
        print(json.dumps([asdict(o) for o in outcomes], indent=1))
    return 0


# the options of `gyre model sft` named as tasks/sft.py sft_model's parameters, passed as they are
SFT_OPTIONS = [
    "train_problems",
    "eval_problems",
    "steps",
    "batch_size",
    "lr",
    "copy_steps",
    "difficulty",
    "seed",
    "eval_seed",
    "recovery_share",
    "give_up_share",
]


def run_sft_command(args: argparse.Namespace) -> int:
    from tasks.sft import sft_model

    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    report = sft_model.fn(
        args.model,
        args.out,
        suites=suites,
        evaluate=not args.no_eval,
        **{name: getattr(args, name) for name in SFT_OPTIONS},
    )
    training = report["training"]
    if "copy" in training:
        copy = training["copy"]
        print(
            f"copy drills: {copy['steps']} steps on {copy['drills']} drills ({copy['words']} words) in "
            f"{copy['train_s']:.0f} s: loss {copy['first_loss']:.3f} -> {copy['final_loss']:.3f}; "
            f"{copy['held_out_confident']:.0%} of held-out drill tokens copied with p > 0.5"
        )
    print(
        f"trained {training['steps']} steps on {training['demonstrations']} demonstrations "
        f"({training['target_tokens']} target tokens) in {training['train_s']:.0f} s: loss "
        f"{training['first_loss']:.3f} -> {training['final_loss']:.3f}; saved to {args.out}"
    )
    if "after" in report:
        columns = ["suite", "pass_rate_before", "pass_rate_after", "mean_reward_before", "mean_reward_after"]
        rows = [
            [
                suite,
                *(
                    report[when][suite][figure]
                    for figure in ("pass_rate", "mean_reward")
                    for when in ("before", "after")
                ),
            ]
            for suite in [*suites, "overall"]
        ]
        print(render(columns, rows))
    if args.report:
        with open(args.report, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0
