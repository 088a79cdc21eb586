"""What one RL step trains: the step's groups, which executions are left out and why, and its batch.

    figures = step_figures(con, step)                       # rewards, statuses, tokens of the step
    batch, left_out = step_batch(con, packing, step, trained_version=3, max_policy_lag=0,
                                 skip_zero_signal=True)
    chunk, counts = step_batch(con, packing, step, ..., group="s3-csv-total")   # one group of it

Both schedules build their batches here: the step flow packs the whole step at once, the scheduler
packs each group as it finishes (``group``); a step's counts are the sum of its groups' counts
(`add_counts`), so both record the same figures.

Two rules decide what is left out before packing (each execution left out is counted by reason):

- **Zero signal**: a group whose trainable members all have the same reward carries no signal (its
  group-relative advantages are all 0); with ``skip_zero_signal`` its members are left out, so they
  do not dilute the per-execution average of the loss (counted either way).
- **Staleness**: every trained token carries the policy version that sampled it; an execution with a
  call older than ``trained_version - max_policy_lag`` is left out, so the bound is never exceeded.
"""

from __future__ import annotations

import duckdb

from trajectory_store.config import PackingConfig
from trajectory_store.processor import PackedBatch, pack

ZERO_SIGNAL = "zero-signal group: every member has the same reward"


def step_figures(con: duckdb.DuckDBPyConnection, step: int) -> dict[str, float]:
    """Executions by status, mean reward and pass rate (reward 1), groups, and tokens of one step.
    An abandoned execution (replaced by a new attempt) counts under its status only: the pass rate and
    the reward are over the executions that ended."""
    step = int(step)
    by_status = dict(
        con.execute("SELECT status, count(*) FROM executions WHERE step = ? GROUP BY ALL", [step]).fetchall()
    )
    executions, graded, reward_sum, passed = con.execute(
        """SELECT count(*), count(*) FILTER (WHERE status <> 'eval_failed' AND reward IS NOT NULL),
                  coalesce(sum(reward) FILTER (WHERE status <> 'eval_failed'), 0),
                  count(*) FILTER (WHERE reward = 1.0 AND status <> 'eval_failed')
           FROM executions WHERE step = ? AND status <> 'abandoned'""",
        [step],
    ).fetchall()[0]
    calls, naive, unique = con.execute(
        """SELECT count(*), coalesce(sum(prompt_len + output_len), 0), coalesce(sum(len(new_ids)), 0)
           FROM calls WHERE step = ?""",
        [step],
    ).fetchall()[0]
    groups = con.execute(
        "SELECT count(DISTINCT coalesce(group_id, problem_id, execution_id)) FROM executions WHERE step = ?",
        [step],
    ).fetchall()[0][0]
    figures = {
        "executions": float(executions),
        "groups": float(groups),
        "mean_reward": reward_sum / graded if graded else 0.0,
        "pass_rate": passed / executions if executions else 0.0,
        "calls": float(calls),
        "tokens_naive": float(naive),
        "tokens_unique": float(unique),
        "naive_over_unique_tokens": naive / unique if unique else 0.0,
    }
    figures.update({f"executions_{status}": float(n) for status, n in by_status.items()})
    return figures


def left_out(
    con: duckdb.DuckDBPyConnection,
    step: int,
    *,
    trained_version: int,
    max_policy_lag: int,
    skip_zero_signal: bool,
) -> dict[str, str]:
    """Execution id -> why it is not trained at this step (zero signal, staleness)."""
    step = int(step)
    reasons: dict[str, str] = {}
    oldest = con.execute(
        "SELECT execution_id, min(policy_version) FROM calls WHERE step = ? GROUP BY ALL", [step]
    ).fetchall()
    for execution_id, version in oldest:
        if trained_version - int(version) > max_policy_lag:
            reasons[execution_id] = (
                f"stale: a call of policy version {version}, trained at version {trained_version} "
                f"(max_policy_lag {max_policy_lag})"
            )
    if skip_zero_signal:
        for execution_id in zero_signal(con, step):
            reasons.setdefault(execution_id, ZERO_SIGNAL)
    return reasons


def zero_signal(con: duckdb.DuckDBPyConnection, step: int) -> list[str]:
    """Trainable executions of ``step`` whose group's rewards are all equal (all-zero advantages)."""
    rows = con.execute(
        """WITH e AS (
               SELECT execution_id, coalesce(group_id, problem_id, execution_id) AS grp, reward
               FROM executions e JOIN trainable_statuses t ON t.status = e.status
               WHERE e.step = ? AND e.reward IS NOT NULL),
           g AS (SELECT grp FROM e GROUP BY grp HAVING max(reward) - min(reward) <= 1e-12)
           SELECT execution_id FROM e JOIN g USING (grp) ORDER BY execution_id""",
        [int(step)],
    ).fetchall()
    return [row[0] for row in rows]


ANOTHER_GROUP = "another group"


def step_batch(
    con: duckdb.DuckDBPyConnection,
    packing: PackingConfig,
    step: int,
    *,
    trained_version: int,
    max_policy_lag: int,
    skip_zero_signal: bool,
    group: str | None = None,
) -> tuple[PackedBatch, dict[str, float]]:
    """The step's packed batch (with ``group``: that group's only), and counts of what was left out
    (by reason), packed and trained: an execution is trained when it is packed and its group carries
    signal (a zero-signal group kept in the batch has advantage 0 everywhere: it counts in the loss's
    average, and teaches nothing). A group's counts are of its own executions."""
    reasons = left_out(
        con,
        step,
        trained_version=trained_version,
        max_policy_lag=max_policy_lag,
        skip_zero_signal=skip_zero_signal,
    )
    no_signal = zero_signal(con, step)
    if group is not None:
        others = {
            row[0]
            for row in con.execute(
                "SELECT execution_id FROM executions WHERE step = ? AND coalesce(group_id, '') <> ?",
                [int(step), group],
            ).fetchall()
        }
        reasons = {e: why for e, why in reasons.items() if e not in others} | dict.fromkeys(
            others, ANOTHER_GROUP
        )
        no_signal = [e for e in no_signal if e not in others]
    batch = pack(con, packing, step=step, exclude=reasons)
    skipped = batch.skipped.values()
    counts = {
        # a zero-signal group kept in the batch (skip_zero_signal False) is packed, advantage 0: not trained
        "executions_trained": float(len(set(batch.advantages) - set(no_signal))),
        "executions_packed": float(len(batch.advantages)),
        "executions_zero_signal": float(len(no_signal)),
        "zero_signal_skipped": float(skip_zero_signal),
        "executions_stale": float(sum(r.startswith("stale") for r in skipped)),
        "executions_untrainable": float(sum(r.startswith("status") or r == "no reward" for r in skipped)),
        "tokens_trained": float(batch.n_target_tokens),
        "tokens_packed": float(batch.n_tokens),
        "tokens_shared": float(batch.n_shared_tokens),  # context tokens packed once for several trees
        "sequences": float(len(batch.sequences)),
    }
    return batch, counts


def add_counts(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """The counts of a step made of groups: each count summed (``zero_signal_skipped``, a setting of
    the step rather than a count, kept)."""
    summed = {name: total.get(name, 0.0) + value for name, value in part.items()}
    if "zero_signal_skipped" in part:
        summed["zero_signal_skipped"] = part["zero_signal_skipped"]
    return {**total, **summed}
