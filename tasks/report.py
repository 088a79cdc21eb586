"""What a campaign shows in the Prefect UI: a progress artifact, a table per step, and a markdown
summary with the reward and pass-rate curves as a PNG (a data: URI, so the UI needs no other URL);
and what its held-out evaluations say, paired by problem (`gyre run`'s summary, `gyre bench learn`).

Artifacts are written from the records the store holds (tasks/commit.py), so a resumed campaign
shows its earlier steps too. Keys are the campaign's name in lowercase letters, digits and dashes.

    gain = held_out_gain(eval_store, before=0, after=4)   # pass-rate gain, its paired 95% interval,
                                                          # problems gained / lost, the give-up rate
"""

from __future__ import annotations

import base64
import io
import itertools
import random
import re
from typing import Any
from uuid import UUID

from prefect import task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.commit import StepRecord
from trajectory_store.storage import Store, StoreConfig

STEP_COLUMNS = (
    ("mean_reward", "reward"),
    ("pass_rate", "pass rate"),
    ("executions", "executions"),
    ("executions_completed", "completed"),
    ("executions_timeout", "timeout"),
    ("executions_error", "error"),
    ("executions_eval_failed", "eval_failed"),
    ("executions_abandoned", "abandoned"),
    ("train_attempts", "train attempts"),
    ("services_revived", "services revived"),
    ("executions_zero_signal", "zero-signal"),
    ("executions_trained", "trained"),
    ("executions_stale", "stale"),
    ("tokens_naive", "tokens as sent"),
    ("tokens_unique", "unique tokens"),
    ("naive_over_unique_tokens", "sent / unique"),
    ("tokens_trained", "trained tokens"),
    ("loss", "loss"),
    ("step_s", "step s"),
    ("switches", "switches"),
    ("switch_to_train_p50_s", "to train s (p50)"),
    ("switch_to_rollout_p50_s", "to rollout s (p50)"),
)

SQL_RECIPES = {
    "reward and pass rate by step": "SELECT step, name, round(value, 3) AS value FROM metrics "
    "WHERE name IN ('mean_reward', 'pass_rate', 'eval_pass_rate') ORDER BY step, name",
    "pass rate by suite (held-out)": "SELECT step AS version, name, value FROM metrics "
    "WHERE name LIKE 'eval_pass_rate_%' ORDER BY step, name",
    "executions of a step": "SELECT execution_id, status, reward, reward_source, n_calls FROM executions "
    "WHERE step = 0 ORDER BY execution_id",
}


def artifact_key(campaign: str, *parts: Any) -> str:
    text = "-".join([campaign, *map(str, parts)]).lower()
    return re.sub(r"[^a-z0-9-]+", "-", text).strip("-") or "campaign"


def _cell(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.3f}"


@task(name="progress", task_run_name="campaign progress")
def start_progress(campaign: str, done: int, total: int) -> UUID:
    return create_progress_artifact(
        100.0 * done / max(total, 1),
        key=artifact_key(campaign, "progress"),
        description=f"campaign {campaign}: committed steps out of {total}",
    )


@task(name="progress-update", task_run_name="campaign progress {done}/{total}")
def update_progress(artifact_id: UUID, done: int, total: int) -> None:
    update_progress_artifact(artifact_id, 100.0 * done / max(total, 1))


@task(name="step-table", task_run_name="table of step {record.step}")
def step_table(campaign: str, record: StepRecord) -> UUID:
    row = {"step": record.step, "version": record.version}
    row.update({label: _cell(record.metrics.get(name)) for name, label in STEP_COLUMNS})
    return create_table_artifact(
        [row],
        key=artifact_key(campaign, "step", record.step),
        description=f"campaign {campaign}, step {record.step}: rewards, executions, tokens and time",
    )


def curves_png(records: list[StepRecord], evaluations: dict[int, dict[str, float]]) -> bytes:
    """Training reward and pass rate per step, held-out pass rate and reward per version, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3), dpi=80)
    steps = [r.step for r in records]
    axis.plot(steps, [r.metrics.get("mean_reward", 0.0) for r in records], "o-", label="train reward")
    axis.plot(steps, [r.metrics.get("pass_rate", 0.0) for r in records], "s-", label="train pass rate")
    versions = sorted(evaluations)
    axis.plot(
        versions, [evaluations[v].get("pass_rate", 0.0) for v in versions], "^--", label="held-out pass rate"
    )
    axis.plot(
        versions, [evaluations[v].get("mean_reward", 0.0) for v in versions], "v--", label="held-out reward"
    )
    axis.set_xlabel("step (policy version)")
    axis.set_ylim(-0.05, 1.05)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def summary_markdown(
    campaign: str, records: list[StepRecord], evaluations: dict[int, dict[str, float]]
) -> str:
    png = base64.b64encode(curves_png(records, evaluations)).decode()
    lines = [f"# Campaign {campaign}", "", f"![reward and pass rate](data:image/png;base64,{png})", ""]
    lines += ["| version | held-out pass rate | held-out reward |", "|---|---|---|"]
    lines += [
        f"| {v} | {_cell(f.get('pass_rate'))} | {_cell(f.get('mean_reward'))} |"
        for v, f in sorted(evaluations.items())
    ]
    lines += ["", "| step | reward | pass rate | trained tokens | step s |", "|---|---|---|---|---|"]
    lines += [
        f"| {r.step} | {_cell(r.metrics.get('mean_reward'))} | {_cell(r.metrics.get('pass_rate'))} | "
        f"{_cell(r.metrics.get('tokens_trained'))} | {_cell(r.metrics.get('step_s'))} |"
        for r in records
    ]
    lines += ["", "## Ask the store", ""]
    for title, sql in SQL_RECIPES.items():
        lines += [f"{title}:", "", "```", f'gyre sql --campaign {campaign} "{sql}"', "```", ""]
    lines += [
        f"The held-out executions are in campaign `{campaign}-eval` (`gyre sql --campaign {campaign}-eval`)."
    ]
    return "\n".join(lines)


@task(name="summary", task_run_name="summary of {campaign}")
def campaign_summary(
    campaign: str, records: list[StepRecord], evaluations: dict[int, dict[str, float]]
) -> UUID:
    return create_markdown_artifact(
        summary_markdown(campaign, records, evaluations),
        key=artifact_key(campaign, "summary"),
        description=f"campaign {campaign}: curves, figures and SQL recipes",
    )


ROLE_COLOURS = {"rollout": "#4c78a8", "train": "#f58518", "switching": "#bab0ac"}


def role_timeline_png(samples: list[dict[str, Any]], commits: list[tuple[float, int]]) -> bytes:
    """Cells on the y axis, their role over time (from the scheduler's heartbeats: wall time, roles,
    cells switching), a dashed line where each step committed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    start = samples[0]["wall"]
    cells = sorted({c for s in samples for c in s["roles"]})
    figure, axis = plt.subplots(figsize=(7, 0.5 * len(cells) + 1.2), dpi=80)
    for row, cell in enumerate(cells):
        for a, b in itertools.pairwise(samples):
            role = "switching" if cell in a["switching"] else a["roles"].get(cell)
            if role:
                axis.barh(
                    row, b["wall"] - a["wall"], left=a["wall"] - start, color=ROLE_COLOURS[role], height=0.8
                )
    for wall, step in commits:
        axis.axvline(wall - start, color="black", linestyle="--", linewidth=0.8)
        axis.text(wall - start, len(cells) - 0.4, f"step {step}", fontsize=7)
    axis.set_yticks(range(len(cells)), cells)
    axis.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLOURS.values()]
    axis.legend(handles, list(ROLE_COLOURS), fontsize=7, loc="upper right", ncol=3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


@task(name="role-timeline", task_run_name="cell roles of {campaign}")
def role_timeline(
    campaign: str, samples: list[dict[str, Any]], commits: list[tuple[float, int]]
) -> UUID | None:
    """A markdown artifact with the cells' roles over time (a PNG as a data: URI)."""
    if len(samples) < 2:
        return None
    png = base64.b64encode(role_timeline_png(samples, commits)).decode()
    text = f"# Cell roles, campaign {campaign}\n\n![cell roles over time](data:image/png;base64,{png})\n"
    return create_markdown_artifact(
        text, key=artifact_key(campaign, "roles"), description=f"campaign {campaign}: cell roles over time"
    )


# -- held-out figures, paired by problem -------------------------------------------------------


def paired_bootstrap(differences: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """The 2.5% and 97.5% percentiles of the mean of ``differences`` resampled with replacement."""
    if not differences:
        return 0.0, 0.0
    rng = random.Random(seed)
    n = len(differences)
    means = sorted(sum(rng.choice(differences) for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def _samples_by_problem(store: StoreConfig, version: int) -> dict[str, list[dict[str, Any]]]:
    """problem id -> the held-out evaluation's executions of ``version`` (only that step's parts read)."""
    rows = Store(store).read_columns("executions", ["problem_id", "reward", "n_calls"], version).to_pylist()
    by_problem: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_problem.setdefault(row["problem_id"], []).append(row)
    return by_problem


def held_out_results(store: StoreConfig, version: int) -> dict[str, tuple[float, float]]:
    """problem id -> (pass rate, mean reward) over the held-out evaluation's samples of ``version``."""
    results = {}
    for problem, rows in _samples_by_problem(store, version).items():
        rewards = [float(r["reward"] or 0.0) for r in rows]
        results[problem] = (sum(r == 1.0 for r in rewards) / len(rewards), sum(rewards) / len(rewards))
    return results


def _gave_up(row: dict[str, Any]) -> bool:
    """Ended after one model call without passing: a ``finish`` before any work (the habit of the
    give-up warm starts, data/policies/tiny-give-up*)."""
    return row["n_calls"] == 1 and float(row["reward"] or 0.0) < 1.0


def gave_up_by_step(store: StoreConfig) -> dict[int, float]:
    """step -> the share of its executions that gave up at once."""
    ended: dict[int, list[bool]] = {}
    for row in Store(store).read_table("executions").to_pylist():
        ended.setdefault(row["step"], []).append(_gave_up(row))
    return {step: sum(flags) / len(flags) for step, flags in sorted(ended.items())}


def gave_up_by_problem(store: StoreConfig, version: int) -> dict[str, float]:
    """problem id -> the share of the held-out evaluation's samples of ``version`` that gave up at once."""
    return {
        problem: sum(map(_gave_up, rows)) / len(rows)
        for problem, rows in _samples_by_problem(store, version).items()
    }


def held_out_gain(eval_store: StoreConfig, before: int, after: int) -> dict[str, Any]:
    """Versions ``before`` and ``after`` on the held-out problems both were evaluated on (the held-out
    evaluation campaign ``eval_store``), paired by problem: pass rates and mean rewards, the pass-rate
    gain with its paired 95% bootstrap interval, the problems gained and lost, and the share of
    executions that gave up at once (one call, not passed) with the interval of its change."""
    first, last = held_out_results(eval_store, before), held_out_results(eval_store, after)
    problems = sorted(set(first) & set(last))
    if not problems:
        raise RuntimeError(
            f"no held-out problem was evaluated both at version {before} and at version {after}"
        )
    passed_before = [first[p][0] for p in problems]
    passed_after = [last[p][0] for p in problems]
    pairs = list(zip(passed_after, passed_before, strict=True))
    low, high = paired_bootstrap([a - b for a, b in pairs])
    quit_before, quit_after = gave_up_by_problem(eval_store, before), gave_up_by_problem(eval_store, after)
    quit_low, quit_high = paired_bootstrap([quit_after[p] - quit_before[p] for p in problems])
    n = len(problems)
    return {
        "held_out_problems": n,
        "pass_rate_before": round(sum(passed_before) / n, 4),
        "pass_rate_after": round(sum(passed_after) / n, 4),
        "mean_reward_before": round(sum(first[p][1] for p in problems) / n, 4),
        "mean_reward_after": round(sum(last[p][1] for p in problems) / n, 4),
        "pass_rate_gain": round((sum(passed_after) - sum(passed_before)) / n, 4),
        "pass_rate_gain_ci95_low": round(low, 4),
        "pass_rate_gain_ci95_high": round(high, 4),
        "problems_gained": sum(a > b for a, b in pairs),
        "problems_lost": sum(a < b for a, b in pairs),
        # held-out executions that ended after one call without passing (gave up before any work)
        "gave_up_before": round(sum(quit_before[p] for p in problems) / n, 4),
        "gave_up_after": round(sum(quit_after[p] for p in problems) / n, 4),
        "gave_up_change_ci95": [round(quit_low, 4), round(quit_high, 4)],
    }
