"""A finite suite's split (train / validation / held_out) and the record a campaign keeps of it.

The user names the split per suite: a list of problem ids, or a fraction chosen by hashing each id
(``hashed_fraction``: stable as problems are added or removed, independent of their order). Training
draws only from ``train``; the held-out evaluation reads ``held_out``; ``validation`` is kept aside.

``split_record`` is what a campaign writes once (``suites.json`` in its folder): per suite, the ids of
each part and a content hash of every problem. ``record_changes`` compares a resumed campaign's
suites with it: a problem added, removed, moved between parts or changed is named, so a campaign never
silently trains on a different suite than the one it started with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from environments.problems import Problem
from environments.suites.spec import Split

PARTS = ("train", "validation", "held_out")


@dataclass
class SuiteSplit:
    """The ids of a finite suite's three parts, each sorted."""

    train: list[str]
    validation: list[str]
    held_out: list[str]


def hashed_fraction(problem_id: str) -> float:
    """A number in [0, 1) fixed by the id alone."""
    return int(hashlib.sha256(problem_id.encode()).hexdigest()[:16], 16) / 2**64


def source_id(problem: Problem) -> str:
    """A suite's problem by the id it has in its source (a folder's name, a manifest's problem_id):
    what ``gyre suite check`` prints, and what ``held_out`` and ``validation`` take whatever the
    campaign names the suite (they take the suite's id, ``<suite>-<source id>``, too)."""
    return str(problem.meta.get("suite_id", problem.problem_id)).removeprefix("folder-")


def content_hash(problem: Problem) -> str:
    return hashlib.sha256(json.dumps(problem.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def split_suite(name: str, problems: list[Problem], held_out: Split, validation: Split) -> SuiteSplit:
    """The three parts of suite ``name``. Listed ids may be the suite's ids (``mine-x``) or the ids the
    problems had in their source (``x``, ``folder-x``); a listed id that matches no problem is an error."""
    ids = {p.problem_id for p in problems}
    aliases = {}
    for problem in problems:
        aliases[problem.problem_id] = problem.problem_id
        aliases.setdefault(str(problem.meta.get("suite_id", problem.problem_id)), problem.problem_id)
        aliases.setdefault(source_id(problem), problem.problem_id)

    def listed(part: str, chosen: list[str]) -> set[str]:
        unknown = sorted(set(chosen) - set(aliases))
        if unknown:
            sources = sorted(source_id(p) for p in problems)
            shown = ", ".join(sources[:30]) + (f", ... ({len(sources)} in all)" if len(sources) > 30 else "")
            raise ValueError(
                f"suite {name}: {part} names problems it does not have: {', '.join(unknown)}; "
                f"its problems are {shown} (or with the suite's prefix, {name}-{sources[0]} ...)"
            )
        return {aliases[i] for i in chosen}

    held: set[str] = set()
    aside: set[str] = set()
    if isinstance(held_out, list):
        held = listed("held_out", held_out)
    if isinstance(validation, list):
        aside = listed("validation", validation) - held
    low = held_out if isinstance(held_out, float) else 0.0
    for problem_id in ids:
        share = hashed_fraction(problem_id)
        if isinstance(held_out, float) and share < held_out:
            held.add(problem_id)
        elif isinstance(validation, float) and low <= share < low + validation and problem_id not in held:
            aside.add(problem_id)
    train = sorted(ids - held - aside)
    if not train:
        raise ValueError(
            f"suite {name}: every one of its {len(ids)} problems is held out or kept for validation"
        )
    return SuiteSplit(train=train, validation=sorted(aside), held_out=sorted(held))


def split_record(suites: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON a campaign keeps; ``suites`` holds per suite its name, kind, source and (finite
    suites) its split and problems by id."""
    out = []
    for suite in suites:
        entry = {"name": suite["name"], "kind": suite["kind"], "source": suite.get("source")}
        if suite["kind"] == "finite":
            by_id: dict[str, Problem] = suite["problems"]
            split: SuiteSplit = suite["split"]
            for part in PARTS:
                entry[part] = {i: content_hash(by_id[i]) for i in getattr(split, part)}
        out.append(entry)
    return {"version": 1, "suites": out}


def record_changes(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a campaign's recorded split and its suites now, one line per difference."""
    changes = []
    old = {s["name"]: s for s in recorded.get("suites", [])}
    new = {s["name"]: s for s in now.get("suites", [])}
    for name in sorted(set(old) - set(new)):
        changes.append(f"suite {name} was in the campaign and is no longer in [problems] suites")
    for name in sorted(set(new) - set(old)):
        changes.append(f"suite {name} is new in [problems] suites")
    for name in sorted(set(old) & set(new)):
        before, after = old[name], new[name]
        if before["kind"] != after["kind"]:
            changes.append(f"suite {name} was {before['kind']} and is now {after['kind']}")
            continue
        if before["kind"] != "finite":
            continue
        where_before = {i: part for part in PARTS for i in before.get(part, {})}
        where_after = {i: part for part in PARTS for i in after.get(part, {})}
        for problem_id in sorted(set(where_before) | set(where_after)):
            was, is_ = where_before.get(problem_id), where_after.get(problem_id)
            if was is None:
                changes.append(f"suite {name}: problem {problem_id} was added ({is_})")
            elif is_ is None:
                changes.append(f"suite {name}: problem {problem_id} was removed (it was in {was})")
            elif was != is_:
                changes.append(f"suite {name}: problem {problem_id} moved from {was} to {is_}")
            elif before[was][problem_id] != after[is_][problem_id]:
                changes.append(f"suite {name}: problem {problem_id} changed (its content hash differs)")
    return changes
