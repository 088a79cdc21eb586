"""What a campaign shows in the Prefect UI: a progress artifact, a table per step, and a markdown
summary with the reward and pass-rate curves as a PNG (a data: URI, so the UI needs no other URL).

Artifacts are written from the records the store holds (tasks/campaign.py), so a resumed campaign
shows its earlier steps too. Keys are the campaign's name in lowercase letters, digits and dashes.
"""

from __future__ import annotations

import base64
import io
import itertools
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

from tasks.campaign import StepRecord

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
