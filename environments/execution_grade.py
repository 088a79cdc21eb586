"""An execution's reward: from its final workspace, or from the stored snapshot of a timed-out one.

    graded = grade_final(problem, workspace, timeout_s=60, retries=2)
    graded = grade_snapshot(problem, workspace, snapshots, step, execution_id, timeout_s=60, retries=2)
    graded.status, graded.reward, graded.source, graded.grade, graded.error, graded.snapshot_uri

The dispatcher (environments/runner.py) runs these off its event loop. Both are total over what an
agent can leave: whatever the workspace holds gives a reward in [0, 1]. A snapshot that cannot be
stored or restored, or a workspace no grading copy can take, scores 0 with the reason in ``error``
and ``grade["ungraded"]`` (never ``error`` or ``eval_failed``, which are never trained on: that
would be an escape from the zero). Only a grader that is broken whatever the workspace holds
(``GraderError`` on every retry) makes the execution ``eval_failed``.
"""

from __future__ import annotations

import logging
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from environments.problems import GraderError, Problem, grade_workspace
from environments.snapshot_rows import sandbox_from_stored, store_workspace
from environments.workspace_tree import remove_tree
from trajectory_store.schema import RewardSource
from trajectory_store.snapshots import SnapshotStore

log = logging.getLogger(__name__)


@dataclass
class Graded:
    """What grading one execution gave."""

    reward: float | None
    """In [0, 1]; None when the grader failed (``eval_failed``)."""
    source: RewardSource | None
    eval_failed: bool = False
    grade: dict[str, Any] | None = None
    """{"passed", "total"} and, for a workspace scored 0 without a grade, "ungraded": why."""
    error: str | None = None
    snapshot_uri: str | None = None


def grade_final(problem: Problem, workspace: Path, *, timeout_s: float, retries: int) -> Graded:
    """Grades ``workspace`` (reward source ``final``), retrying a failed grader ``retries`` times."""
    return _grade(problem, workspace, "final", timeout_s, retries)


def grade_snapshot(
    problem: Problem,
    workspace: Path,
    snapshots: SnapshotStore,
    step: int,
    execution_id: str,
    *,
    timeout_s: float,
    retries: int,
) -> Graded:
    """Stores ``workspace`` as a snapshot and grades what was stored, restored into a fresh folder
    (reward source ``workspace_snapshot``); a missing workspace is a reward-0 placeholder."""
    if not workspace.is_dir():
        return Graded(0.0, "placeholder")
    try:
        uri = store_workspace(
            snapshots,
            step,
            execution_id,
            workspace,
            problem_id=problem.problem_id,
            source="timeout",
            template_files=problem.files,
        )
    except Exception as exc:  # the walk never raises for the workspace: this is a failure of ours
        log.exception("execution %s: its workspace could not be snapshotted", execution_id)
        return _ungraded(f"the snapshot could not be stored: {type(exc).__name__}: {exc}")
    fresh = Path(tempfile.mkdtemp(prefix="gyre-regrade-"))
    try:
        try:
            restored = sandbox_from_stored(snapshots, uri, fresh, secrets.token_hex(8))
        except Exception as exc:  # what was stored within the walk's limits always restores
            log.exception("execution %s: its snapshot %s could not be restored", execution_id, uri)
            graded = _ungraded(f"the snapshot could not be restored: {type(exc).__name__}: {exc}")
        else:
            graded = _grade(problem, restored.workspace, "workspace_snapshot", timeout_s, retries)
    finally:
        remove_tree(fresh)
    graded.snapshot_uri = uri
    return graded


def _grade(problem: Problem, workspace: Path, source: RewardSource, timeout_s: float, retries: int) -> Graded:
    errors = []
    for _ in range(retries + 1):
        try:
            result = grade_workspace(problem, workspace, timeout_s=timeout_s)
        except GraderError as exc:
            errors.append(str(exc))
            continue
        grade: dict[str, Any] = {"passed": result.passed, "total": result.total}
        if result.ungraded is not None:
            grade["ungraded"] = result.ungraded
        return Graded(result.reward, source, grade=grade, error=_why(result.ungraded))
    return Graded(
        None, None, eval_failed=True, error=f"the grader failed {len(errors)} times; last: {errors[-1]}"
    )


def _ungraded(why: str) -> Graded:
    return Graded(0.0, "placeholder", grade={"passed": 0, "total": 1, "ungraded": why}, error=_why(why))


def _why(ungraded: str | None) -> str | None:
    return None if ungraded is None else f"ungraded, scored 0: {ungraded}"
