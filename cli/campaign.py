"""The campaign commands of `gyre`: the services, the run, deployments, and the campaign benchmarks.

gyre up [--config configs/demo.toml]       Prefect server + UI, rollout engines, gateway (loopback)
        [--watch]                           ... and start again any of them that dies
gyre status                                 each service with its pid, address and health
gyre down                                   stops what `gyre up` started, nothing else
gyre run [--config configs/demo.toml]       up + the campaign (progress on stderr) + a summary
         [--check]                          ... only the checks it makes first (cli/run_check.py), nothing started
         [--policy DIR]                     ... starting from another policy (any Llama/Qwen2/Qwen3/Mistral folder)
gyre deploy [--file deployments/prefect.yaml]   the scheduled campaigns, on the server
gyre deploy --cells campaign.toml           the cells of its [cluster] hosts, one deployment a host
gyre worker [--pool gyre]                   a process worker that runs them
gyre bench learn [--quick] [--validation]   does the campaign teach the policy (held-out, paired)
gyre bench ui [--out bench/results/ui.png]  a screenshot of a campaign in the Prefect UI
gyre bench ui --mlflow [--config C]         ... of the config's campaign in the MLflow UI (mlflow.png)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, TextColumn
from rich.progress import Progress as RichProgress

from cli import settings
from cli.format import render

DEMO_CONFIG = "configs/demo.toml"


def add_campaign_parsers(commands, bench_commands) -> None:
    run = commands.add_parser(
        "run", help="start the services (gyre up), run the demo campaign and print its summary"
    )
    run.add_argument("--config", default=DEMO_CONFIG, help="campaign config (TOML)")
    run.add_argument("--data-root", default=None, help="override [store].data_root")
    run.add_argument("--steps", type=int, default=None, help="override steps")
    run.add_argument("--name", default=None, help="override the campaign's name")
    run.add_argument(
        "--check",
        action="store_true",
        help="only check the config, the policy folder and every suite's problems, splits and ids, then "
        "exit (nothing is started; gyre run does the same check first)",
    )

    up = commands.add_parser(
        "up", help="start a Prefect server (with its UI), the rollout engines and the gateway"
    )
    up.add_argument(
        "--config", default=DEMO_CONFIG, help="campaign config: its policy, [serving] and [store]"
    )
    up.add_argument("--data-root", default=None, help="override [store].data_root")
    up.add_argument(
        "--watch",
        action="store_true",
        help="stay in the foreground and start again any service whose process dies (Ctrl-C stops watching)",
    )
    for command in (run, up):
        command.add_argument(
            "--policy",
            default=None,
            help="override the config's policy: a local Hugging Face folder of a Llama, Qwen2, Qwen3 or "
            "Mistral model (checked first, as `gyre model check` does)",
        )
        _engine_option(command, "ours, or vLLM's server in its own environment (make vllm)")
        command.add_argument("--prefect-port", type=int, default=4200, help="0: any free port")
        command.add_argument("--gateway-port", type=int, default=8200, help="0: any free port")
        command.add_argument(
            "--engine-port", type=int, default=8100, help="first engine's port (0: any free port)"
        )
    for name, text in (("status", "the services gyre up started, with health"), ("down", "stop them")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", default=DEMO_CONFIG, help="campaign config (its [store].data_root)")
        command.add_argument("--data-root", default=None, help="override [store].data_root")

    deploy = commands.add_parser("deploy", help="register the scheduled campaigns with the Prefect server")
    deploy.add_argument("--file", default="deployments/prefect.yaml", help="the deployments (prefect.yaml)")
    deploy.add_argument(
        "--data-root", default=None, help="whose `gyre up` server to use (without PREFECT_API_URL)"
    )
    deploy.add_argument(
        "--cells",
        metavar="CONFIG",
        default=None,
        help="instead: the cell deployments (gyre-cell/<host>) of this campaign config's [cluster] hosts",
    )
    worker = commands.add_parser("worker", help="run a process worker for the scheduled campaigns")
    worker.add_argument("--pool", default="gyre", help="the work pool")
    worker.add_argument(
        "--data-root", default=None, help="whose `gyre up` server to use (without PREFECT_API_URL)"
    )

    learn = bench_commands.add_parser(
        "learn", help="a campaign from the warm start: held-out pass rate before/after"
    )
    learn.add_argument("--quick", action="store_true", help="configs/learn-quick.toml (what make run shows)")
    learn.add_argument("--config", default=None, help="another campaign config")
    learn.add_argument("--out", default="bench/results/learn.json", help="where the figures go (JSON)")
    learn.add_argument("--data-root", default=None, help="keep the data here (default: a temporary folder)")
    _engine_option(learn, "the same recipe, the same seeds")
    learn.add_argument(
        "--validation",
        action="store_true",
        help="evaluate on validation problems (generator seed 20000) instead of the held-out ones: "
        "choose a recipe here, never on the held-out set",
    )
    ui = bench_commands.add_parser(
        "ui", help="a screenshot of a campaign in the Prefect UI (headless chromium)"
    )
    ui.add_argument(
        "--out", default=None, help="the screenshot (default: bench/results/ui.png, mlflow.png with --mlflow)"
    )
    ui.add_argument(
        "--mlflow", action="store_true", help="the MLflow UI of the config's campaign, synced from its store"
    )
    ui.add_argument("--config", default=DEMO_CONFIG, help="campaign config of the campaign shown")
    ui.add_argument("--steps", type=int, default=1, help="steps of that campaign")


def _engine_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--engine", choices=("gyre", "vllm"), default=None, help=f"override [serving] engine: {what}"
    )


def _config(args: argparse.Namespace):
    from flows.config import CampaignConfig

    config = CampaignConfig.from_toml(getattr(args, "config", None) or DEMO_CONFIG)
    overrides: dict = {}
    if getattr(args, "data_root", None):
        overrides["store"] = {"data_root": args.data_root}
    if getattr(args, "steps", None) is not None:
        overrides["steps"] = args.steps
    if getattr(args, "name", None):
        overrides["name"] = args.name
    if getattr(args, "policy", None):
        overrides["policy"] = args.policy
    if getattr(args, "engine", None):
        overrides["serving"] = {"engine": args.engine}
    return config.merged(overrides)


def check_policy(policy: str) -> None:
    """Refuses, before any service starts, a local policy folder gyre cannot serve or train (a
    PolicyError names the folder and what is wrong); a remote URL is checked by the services."""
    if "://" in policy:
        return
    from engines.model.policy import inspect_policy

    inspect_policy(policy)


def _server_url(data_root: str) -> str:
    from stack.up import read_record

    url = settings.prefect_api_url()
    if url:
        return url
    record = read_record(data_root)
    if record is None:
        raise ValueError(
            f"no Prefect server: set PREFECT_API_URL, or start one with `gyre up` (data root {data_root})"
        )
    return record.prefect_api_url


def run_campaign_command(args: argparse.Namespace) -> int:
    if args.command == "up":
        record = _up(args, quiet=False)
        if getattr(args, "watch", False):
            _watch_forever(record.data_root)
        return 0
    if args.command == "status":
        return _status(_config(args).store.data_root)
    if args.command == "down":
        from stack.up import down

        data_root = _config(args).store.data_root
        stopped = down(data_root)
        print(f"stopped {', '.join(stopped)}" if stopped else f"nothing gyre up started runs for {data_root}")
        return 0
    if args.command == "run":
        return _run(args)
    if args.command == "deploy":
        return _deploy(args)
    if args.command == "worker":
        from deployments.deploy import worker_command

        url = _server_url(args.data_root or settings.default_data_root())
        settings.use_prefect_server(url)  # the worker process inherits it
        from stack.zombies import heartbeat_env

        os.environ.update(heartbeat_env())  # and its flow runs beat (stack/zombies.py)
        command = worker_command(args.pool)
        print(f"worker for pool {args.pool} on {url}", file=sys.stderr)
        os.execv(command[0], command)
    if args.command == "bench" and args.bench_command == "learn":
        from bench.learn import main as bench_learn

        return bench_learn(
            quick=args.quick,
            out=args.out,
            config=args.config,
            data_root=args.data_root,
            validation=args.validation,
            engine=args.engine,
        )
    if args.command == "bench" and args.bench_command == "ui":
        from bench.ui import main as bench_ui

        if args.mlflow:
            from bench.ui import mlflow_main

            return mlflow_main(out=args.out or "bench/results/mlflow.png", config_path=args.config)
        return bench_ui(out=args.out or "bench/results/ui.png", config_path=args.config, steps=args.steps)
    raise ValueError(f"unknown command {args.command!r}")


def _ports(args: argparse.Namespace) -> dict[str, int]:
    return {
        name: getattr(args, name, default)
        for name, default in (("prefect_port", 4200), ("gateway_port", 8200), ("engine_port", 8100))
    }


def _up(args: argparse.Namespace, quiet: bool):
    from stack.up import up

    config = _config(args)
    check_policy(config.policy)
    record = up(
        config.store.data_root,
        config.policy,
        config.serving,
        prefect_api_url=settings.prefect_api_url(),
        **_ports(args),
    )
    if not quiet:
        _status(config.store.data_root)
        print(
            f"Prefect UI: {record.prefect_ui_url or record.prefect_api_url}; `gyre down` stops the services"
        )
    return record


def _say_revived(names: list[str], error: Exception | None) -> None:
    stamp = time.strftime("%H:%M:%S")
    if error is not None:
        print(f"\n{stamp} gyre: a service did not start again: {error}", file=sys.stderr, flush=True)
    else:
        print(
            f"\n{stamp} gyre: started again {', '.join(names)} (its process had died)",
            file=sys.stderr,
            flush=True,
        )


def _watch_forever(data_root: str) -> None:
    from stack.up import watch

    print("watching: a service whose process dies is started again (Ctrl-C stops watching)", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        watch(data_root, threading.Event(), on_revive=_say_revived)


def _status(data_root: str) -> int:
    from stack.up import status

    rows = status(data_root)
    if not rows:
        print(f"no services of gyre up for {data_root}")
        return 0
    columns = ["name", "pid", "url", "running", "healthy", "starts", "log"]
    print(render(columns, [[row[c] for c in columns] for row in rows]))
    return 0 if all(row["healthy"] for row in rows) else 1


def _deploy(args: argparse.Namespace) -> int:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.deploy import register

    url = _server_url(args.data_root or settings.default_data_root())
    if args.cells is not None:
        return _deploy_cells(args.cells, url)
    from stack.zombies import ensure_zombie_automation

    with temporary_settings({PREFECT_API_URL: url}):
        ids = register(args.file)
        asyncio.run(ensure_zombie_automation())  # the runs of these deployments beat: find the dead ones
    for name, deployment_id in ids.items():
        print(f"deployed {name} ({deployment_id})")
    print(f"on {url}; `gyre worker` runs them")
    return 0


def _deploy_cells(config_path: str, url: str) -> int:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deployments.cells import deploy_cells
    from flows.config import CampaignConfig

    config = CampaignConfig.from_toml(config_path)
    if config.cluster is None:
        print(
            f"gyre deploy --cells: {config_path} has no [cluster]: its cells run on this machine",
            file=sys.stderr,
        )
        return 2
    with temporary_settings({PREFECT_API_URL: url}):
        ids = deploy_cells(config.cluster)
    for host in config.cluster.hosts:
        print(
            f"deployed gyre-cell/{host.name} ({ids[host.name]}) on pool {host.pool()}: on {host.name} "
            f"({host.address}) run `PREFECT_API_URL={url} gyre worker --pool {host.pool()}`"
        )
    return 0


class Progress:
    """A rich progress bar on stderr, refreshed every few seconds: committed steps and the current
    step's executions (or, before a step's first execution, the held-out evaluation of that version)."""

    def __init__(self, config) -> None:
        self.config = config
        self.expected = config.problems.per_step * config.dispatch.group_size
        self.held_out: int | None = None  # the held-out executions of one evaluation, counted once
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.bar = RichProgress(
            BarColumn(bar_width=24), TextColumn("{task.description}"), console=Console(stderr=True)
        )
        self.task = self.bar.add_task("", total=max(config.steps, 1))

    def __enter__(self) -> Progress:
        self.bar.start()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.bar.stop()

    def _held_out_executions(self) -> int:
        """Generated suites give per_suite held-out problems each; a finite suite its held_out part."""
        if self.held_out is None:
            from tasks.problems import held_out_problems

            evaluation = self.config.evaluation
            problems = self.config.problems
            count = evaluation.per_suite * len(problems.suites)
            if not problems.round_robin:
                count = len(held_out_problems(evaluation, problems))
            self.held_out = count * evaluation.samples
        return self.held_out

    def state(self) -> tuple[float, str]:
        """(steps done, a fraction of the current step included; what the bar says)."""
        from tasks.commit import committed_steps
        from trajectory_store.storage import Store, StoreConfig

        store: StoreConfig = self.config.store.model_copy(update={"campaign": self.config.name})
        done = len(committed_steps(store))
        rows = Store(store).read_table("executions").to_pylist()
        current = [r for r in rows if r["step"] == done]
        rewards = [r["reward"] for r in current if r["reward"] is not None]
        completed = done + min(len(current), self.expected) / max(self.expected, 1)
        head = f"{done}/{self.config.steps} steps committed; "
        if not current:  # before a step's first execution: the held-out evaluation of that version, if due
            expected = self._held_out_executions()
            held_out = Store(store.model_copy(update={"campaign": f"{self.config.name}-eval"}))
            evaluated = held_out.read_columns("executions", ["execution_id"], done).num_rows
            if 0 < evaluated < expected:
                return (
                    completed,
                    head + f"evaluating version {done}: {evaluated}/{expected} held-out executions",
                )
        if done >= self.config.steps:  # every step committed (the last evaluation, if running, is above)
            return completed, head.removesuffix("; ")
        reward = f", mean reward {sum(rewards) / len(rewards):.2f}" if rewards else ""
        return completed, head + f"step {done}: {len(current)}/{self.expected} executions{reward}"

    def line(self) -> str:
        return self.state()[1]

    def _run(self) -> None:
        while not self.stop.wait(3):
            try:
                completed, text = self.state()
            except Exception:  # a half-written part is read next time; the bar is only a view
                continue
            self.bar.update(self.task, completed=completed, description=text, refresh=True)


def _run(args: argparse.Namespace) -> int:
    from cli.run_check import check_campaign, say

    config = _config(args)
    path = args.config or DEMO_CONFIG
    check = check_campaign(config, path)  # before anything starts (cli/run_check.py)
    say(check, path, every_line=args.check)
    if check.errors:
        return 1
    if args.check:
        return 0
    settings.configure_prefect(settings.data_root_of(args))  # creates the data root: only now
    if config.cluster is not None:  # the cells run on the hosts: nothing of `gyre up` is needed here
        api_url = settings.prefect_api_url()
        if api_url is None:
            print(
                "gyre run: a campaign with [cluster] needs a Prefect server every host reaches: start one "
                "(`prefect server start --host 0.0.0.0`) and set PREFECT_API_URL here and on each host",
                file=sys.stderr,
            )
            return 2
        ui_url, services_note = api_url.removesuffix("/api"), "the cells stop with the campaign"
        watched = None
    else:
        from stack.up import campaign_stack

        data_root, api = config.store.data_root, settings.prefect_api_url()
        record, shared = campaign_stack(
            data_root, config.policy, config.serving, prefect_api_url=api, **_ports(args)
        )
        api_url, ui_url = record.prefect_api_url, record.prefect_ui_url or record.prefect_api_url
        services_note = "`gyre down` stops the services"
        watched = {"on_revive": _say_revived}  # a service that dies while the campaign runs starts again
        if not shared:  # gyre up's stack serves another policy: it stays as it is (stack/up.py)
            print(
                f"gyre up's services serve policy {record.policy}: this campaign starts engines and a gateway "
                f"of its own for {config.policy}, beside them, for its duration",
                flush=True,
            )
            services_note = "its engines stopped with it; `gyre down` stops gyre up's services"
            watched["only"] = ("prefect",)  # of gyre up's services, only the Prefect server is the campaign's
    print(f"Prefect UI: {ui_url}/runs  (campaign {config.name})", flush=True)
    from tasks.tracking import open_commands

    for line in open_commands(config.tracking, config.store.model_copy(update={"campaign": config.name})):
        print(line, flush=True)  # MLflow and TensorBoard (tasks/tracking.py)
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.campaign import campaign
    from tasks.commit import committed_evaluations, committed_steps

    started = time.time()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    from stack.up import watch
    from stack.zombies import HEARTBEAT_S

    beating = {PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: HEARTBEAT_S}
    stop = threading.Event()
    if watched is not None:
        threading.Thread(target=watch, args=(data_root, stop), kwargs=watched, daemon=True).start()
    try:
        with (
            temporary_settings(beating),
            Progress(config),
        ):  # a killed campaign is found (stack/zombies.py)
            campaign(config)
    finally:
        stop.set()
    store = config.store.model_copy(update={"campaign": config.name})
    steps = committed_steps(store)
    columns = [
        "step",
        "version",
        "mean_reward",
        "pass_rate",
        "executions",
        "executions_trained",
        "tokens_trained",
        "step_s",
    ]
    rows = [[r.step, r.version, *[round(r.metrics.get(c, 0.0), 3) for c in columns[2:]]] for r in steps]
    print(render(columns, rows))
    evaluations = committed_evaluations(store)
    if not check.held_out:
        print("held-out evaluation: off, no problem of any suite is held out (give a suite held_out = [ids])")
    for version, figures in evaluations.items():
        print(
            f"held-out version {version}: pass rate {figures.get('pass_rate', 0):.3f}, mean reward {figures.get('mean_reward', 0):.3f}"
        )
    if 0 in evaluations and config.steps in evaluations:
        from flows.campaign import campaign_store
        from tasks.report import held_out_gain

        learned = held_out_gain(campaign_store(config)[1], 0, config.steps)
        print(
            f"held-out gain {learned['pass_rate_gain']} (95% CI [{learned['pass_rate_gain_ci95_low']}, "
            f"{learned['pass_rate_gain_ci95_high']}], paired over {learned['held_out_problems']} problems; "
            f"{learned['problems_gained']} gained, {learned['problems_lost']} lost); gave up at once "
            f"{learned['gave_up_before']:.1%} -> {learned['gave_up_after']:.1%}"
        )
    print(
        f"campaign {config.name}: {len(steps)} steps in {(time.time() - started) / 60:.1f} min; data in "
        f'{config.store.data_root}; `gyre sql --campaign {config.name} "SELECT * FROM metrics"`; '
        f"UI {ui_url}; {services_note}"
    )
    return 0
