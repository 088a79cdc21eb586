"""SuiteSpec: one entry of a campaign's ``[problems] suites`` (or what ``gyre suite check`` is given).

A spec names the suite and says where its problems come from; environments/suites/sources.py opens
it. ``SuiteSpec.of("repo")`` is the plain-string form (a built-in or installed suite by name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_]+$")
"""Letters, digits and ``_``: a problem id starts with its suite's name and a ``-`` (the per-suite
evaluation figures read the name back as the id's part before the first ``-``)."""

Split = list[str] | float | None
"""A user split: the problem ids it holds, or a fraction of the suite chosen by hashing each problem's
id (stable as problems are added), or None (nothing)."""


@dataclass
class SuiteSpec:
    """One problem suite of a campaign: where its problems come from, its weight and its split."""

    name: str
    """the suite's name: its problems' ``suite`` and the prefix of their ids (letters, digits, ``_``);
    alone (no path, no entry_point) it names a built-in generator (repo, swe, terminal) or a suite
    installed under the ``gyrerl.suites`` entry points"""
    path: str | None = None
    """a folder of problem folders, or a manifest (``.jsonl``: one Problem JSON a line; ``.parquet``:
    one a row); relative to the campaign config's folder when the config is read from a file"""
    entry_point: str | None = None
    """``module:function`` (or the name of a ``gyrerl.suites`` entry point) that gives the problems: a
    GeneratedSuite, or an iterable of Problem (or Problem JSON); with ``path``, it is called with it"""
    weight: float = 1.0
    """share of each step's problems, relative to the other suites' weights (> 0)"""
    harness: list[str] | None = None
    """the external harness command of this suite's problems (the placeholders of
    [dispatch] harness_command); unset: the campaign's harness"""
    held_out: Split = None
    """problems of a finite suite kept for the held-out evaluation, never trained on: a list of ids,
    or a fraction (chosen by hashing ids); generated suites take theirs from [evaluation] seed"""
    validation: Split = None
    """problems of a finite suite kept aside (never trained on, never in the held-out evaluation):
    a list of ids or a fraction, as held_out"""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_PATTERN.match(self.name):
            raise ValueError(
                f"suite name {self.name!r} must be letters, digits and _ only (it starts its problems' ids)"
            )
        if not self.weight > 0:
            raise ValueError(f"suite {self.name}: weight must be > 0, got {self.weight}")
        for key in ("held_out", "validation"):
            value = getattr(self, key)
            if isinstance(value, float | int) and not isinstance(value, bool):
                if not 0 <= value < 1:
                    raise ValueError(f"suite {self.name}: {key} as a fraction must be in [0, 1), got {value}")
                setattr(self, key, float(value))
        fractions = [v for v in (self.held_out, self.validation) if isinstance(v, float)]
        if sum(fractions) >= 1:
            raise ValueError(f"suite {self.name}: held_out + validation leave no problem to train on")
        if isinstance(self.held_out, list) and isinstance(self.validation, list):
            both = sorted(set(self.held_out) & set(self.validation))
            if both:
                raise ValueError(f"suite {self.name}: problems {both} are in both held_out and validation")
        if self.harness is not None and not (
            self.harness and all(isinstance(part, str) for part in self.harness)
        ):
            raise ValueError(f"suite {self.name}: harness must be a non-empty list of strings")

    @classmethod
    def of(cls, entry: str | SuiteSpec) -> SuiteSpec:
        """A plain name as a spec (a spec stays itself)."""
        return entry if isinstance(entry, SuiteSpec) else cls(name=entry)

    @property
    def finite_source(self) -> bool:
        """Whether the spec points at data (a folder or manifest) rather than at a suite by name."""
        return self.path is not None

    def relative_to(self, base: str | Path) -> SuiteSpec:
        """The spec with a relative ``path`` taken from ``base`` (the campaign config's folder)."""
        if self.path is None or Path(self.path).is_absolute():
            return self
        return SuiteSpec(**{**vars(self), "path": str((Path(base) / self.path).resolve())})
