"""A campaign's suites together: each step's problems apportioned across them by weight.

    mix = SuiteMix.open(specs, seed=5000, per_step=4, rounds=1, difficulty=1, length=1)
    mix.step_problems(step=3, round=0)     # the same problems every time
    mix.held_out(per_suite=8, seed=0)      # the held-out evaluation's problems

The apportionment of round ``r`` of step ``n`` (``apportion``): each suite gets the whole part of its
quota ``per_step * weight / total weight``; the seats left go by a systematic draw over the quotas'
fractional parts, seeded by (seed, n, r). A suite thus gets the floor or the ceiling of its quota, and
exactly its quota on average: over many steps the counts are proportional to the weights.

A generated suite's problems of step n come from generator seed ``seed + n`` (round r continues after
the earlier rounds' ones); with ``pool`` > 0 a generated suite is a finite one of ``pool`` problems
from generator seed ``seed``. A finite suite goes through its training split in epochs: epoch e is the
split in a seeded shuffle of its own, and the suite's problems of (n, r) are the next ones in that
stream, counted as if every step ran every round; an epoch's first problems are none of the last
epoch's last ones (a step may straddle the two). A step never gets the same problem twice, and never
a held-out or validation one; each training problem comes once per epoch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from environments.problems import Problem
from environments.suites.sources import (
    FiniteSuite,
    GeneratedSuite,
    SuiteError,
    generated_problems,
    open_suite,
)
from environments.suites.spec import SuiteSpec
from environments.suites.split import SuiteSplit, split_record, split_suite


def apportion(weights: list[float], n: int, key: str) -> list[int]:
    """``n`` seats over ``weights``: whole quotas, the rest by a systematic draw seeded by ``key``."""
    total = sum(Fraction(w) for w in weights)
    quotas = [n * Fraction(w) / total for w in weights]
    seats = [math.floor(q) for q in quotas]
    point = Fraction(random.Random(key).random())  # points at point, point + 1, ... over the fractions
    low = Fraction(0)
    for index, quota in enumerate(quotas):
        high = low + quota - seats[index]
        seats[index] += math.ceil(high - point) - math.ceil(low - point)
        low = high
    return seats


@dataclass
class MixedSuite:
    """One suite of the mix: its spec, its generator (a generated suite) and, for a finite one (or a
    generated one's pool), its problems and split."""

    spec: SuiteSpec
    generated: GeneratedSuite | None = None
    problems: dict[str, Problem] = field(default_factory=dict)
    split: SuiteSplit | None = None


@dataclass
class SuiteMix:
    suites: list[MixedSuite]
    seed: int
    per_step: int
    rounds: int
    """rounds a step may run (1 + top-up rounds): a finite suite's stream counts them all"""
    difficulty: int = 1
    length: int = 1
    _starts: dict[int, list[int]] = field(default_factory=dict, repr=False)
    """step -> what _start gave for it (the sums grow with the step: each is computed once)"""
    _orders: dict[tuple[str, int], list[str]] = field(default_factory=dict, repr=False)
    """(suite, epoch) -> its order (each epoch's depends on the one before)"""

    @classmethod
    def open(
        cls,
        specs: list[SuiteSpec],
        *,
        seed: int,
        per_step: int,
        rounds: int = 1,
        difficulty: int = 1,
        length: int = 1,
        pool: int = 0,
    ) -> SuiteMix:
        """Opens every suite and splits the finite ones; SuiteError names a suite that cannot serve."""
        names = [s.name for s in specs]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise SuiteError(f"suites {doubled} appear twice in [problems] suites; names must be unique")
        suites = []
        for spec in specs:
            opened = open_suite(spec)
            if isinstance(opened, GeneratedSuite) and not pool:
                suites.append(MixedSuite(spec, generated=opened))
                continue
            if isinstance(opened, GeneratedSuite):  # a fixed pool of it
                problems = generated_problems(
                    opened, spec, pool, seed=seed, difficulty=difficulty, length=length
                )
                suites.append(replace(_finite(spec, FiniteSuite(problems, [])), generated=opened))
                continue
            suites.append(_finite(spec, opened))
        mix = cls(suites, seed, per_step, rounds, difficulty, length)
        mix._check_room()
        return mix

    # -- training ----------------------------------------------------------------------------

    def allocation(self, step: int, round: int) -> list[int]:
        """Problems per suite in round ``round`` of step ``step``."""
        weights = [s.spec.weight for s in self.suites]
        return apportion(weights, self.per_step, f"gyre-suites/{self.seed}/{step}/{round}")

    def step_problems(self, step: int, round: int = 0) -> list[Problem]:
        """The problems of round ``round`` of step ``step``, interleaved suite by suite."""
        counts = self.allocation(step, round)
        earlier = [sum(c) for c in zip(*(self.allocation(step, r) for r in range(round)), strict=True)]
        earlier = earlier or [0] * len(self.suites)
        chosen = []
        for index, suite in enumerate(self.suites):
            skip, count = earlier[index], counts[index]
            if suite.split is None and suite.generated is not None:
                problems = generated_problems(
                    suite.generated,
                    suite.spec,
                    skip + count,
                    seed=self.seed + step,
                    difficulty=self.difficulty,
                    length=self.length,
                )
                chosen.append(problems[skip:])
            else:
                step_total = sum(self.allocation(step, r)[index] for r in range(self.rounds))
                ids = self._stream(suite, self._start(step)[index], step_total)[skip : skip + count]
                chosen.append([suite.problems[i] for i in ids])
        width = max((len(c) for c in chosen), default=0)
        return [c[j] for j in range(width) for c in chosen if j < len(c)]

    def _start(self, step: int) -> list[int]:
        """Per suite, how many problems the steps before ``step`` took (every round counted)."""
        known = max((s for s in self._starts if s <= step), default=None)
        if known is None:
            at, starts = 0, [0] * len(self.suites)
        else:
            at, starts = known, list(self._starts[known])
        while at < step:
            for round in range(self.rounds):
                starts = [a + b for a, b in zip(starts, self.allocation(at, round), strict=True)]
            at += 1
        self._starts[step] = starts
        return starts

    def _stream(self, suite: MixedSuite, start: int, count: int) -> list[str]:
        """``count`` distinct training ids from position ``start`` of the suite's epoch stream."""
        size = len(suite.split.train) if suite.split else 0
        taken: list[str] = []
        position = start
        while len(taken) < count:
            epoch, index = divmod(position, size)
            problem_id = self._order(suite, epoch)[index]
            if problem_id not in taken:  # only where an epoch could not be kept apart from the last
                taken.append(problem_id)
            position += 1
        return taken

    def _order(self, suite: MixedSuite, epoch: int) -> list[str]:
        """Epoch ``epoch`` of a finite suite: its training ids in a seeded shuffle, rearranged so that
        its first ids are none of the previous epoch's last (a step's problems can straddle the two)."""
        name = suite.spec.name
        done = max((e for n, e in self._orders if n == name and e <= epoch), default=-1)
        window = self._most(suite) - 1
        while done < epoch:
            done += 1
            order = list(suite.split.train if suite.split else [])
            random.Random(f"gyre-epoch/{self.seed}/{name}/{done}").shuffle(order)
            if done > 0 and window > 0:
                tail = set(self._orders[(name, done - 1)][-window:])
                for i in range(min(window, len(order))):
                    if order[i] in tail:
                        later = next((j for j in range(window, len(order)) if order[j] not in tail), None)
                        if later is not None:
                            order[i], order[later] = order[later], order[i]
            self._orders[(name, done)] = order
        return self._orders[(name, epoch)]

    def _most(self, suite: MixedSuite) -> int:
        """The most problems one step takes of ``suite`` (every round run)."""
        total = sum(s.spec.weight for s in self.suites)
        return self.rounds * math.ceil(self.per_step * suite.spec.weight / total)

    def _check_room(self) -> None:
        for suite in self.suites:
            if suite.split is None:
                continue
            most = self._most(suite)
            if len(suite.split.train) < most:
                raise SuiteError(
                    f"suite {suite.spec.name} has {len(suite.split.train)} problems to train on, but a step "
                    f"may take {most} of it ({self.per_step} per step x {self.rounds} round(s) x its weight "
                    "share) and never takes one twice: add problems, or lower its weight or per_step"
                )

    # -- evaluation and the record -----------------------------------------------------------

    def held_out(self, per_suite: int, seed: int) -> list[Problem]:
        """The held-out evaluation's problems: a generated suite's ``per_suite`` from generator seed
        ``seed``, a finite suite's held-out part (the first ``per_suite`` ids in order)."""
        out: list[Problem] = []
        for suite in self.suites:
            if suite.generated is not None:
                out += generated_problems(
                    suite.generated,
                    suite.spec,
                    per_suite,
                    seed=seed,
                    difficulty=self.difficulty,
                    length=self.length,
                )
            elif suite.split is not None:
                out += [suite.problems[i] for i in suite.split.held_out[:per_suite]]
        return out

    def record(self) -> dict[str, Any]:
        """The split record (environments/suites/split.py) of these suites."""
        return split_record(
            [
                {
                    "name": s.spec.name,
                    "kind": "finite" if s.split is not None else "generated",
                    "source": s.spec.path or s.spec.entry_point or s.spec.name,
                    "problems": s.problems,
                    "split": s.split,
                }
                for s in self.suites
            ]
        )


def _finite(spec: SuiteSpec, opened: FiniteSuite) -> MixedSuite:
    if opened.errors:
        shown = "\n  ".join(opened.errors[:20])
        more = f"\n  ... and {len(opened.errors) - 20} more" if len(opened.errors) > 20 else ""
        raise SuiteError(
            f"suite {spec.name}: {len(opened.errors)} broken problem(s) (gyre suite check shows each):\n  "
            f"{shown}{more}"
        )
    if not opened.problems:
        raise SuiteError(f"suite {spec.name} has no problems")
    by_id: dict[str, Problem] = {}
    for problem in opened.problems:
        if problem.problem_id in by_id:
            raise SuiteError(f"suite {spec.name}: problem id {problem.problem_id} appears twice")
        by_id[problem.problem_id] = problem
    try:
        split = split_suite(spec.name, opened.problems, spec.held_out, spec.validation)
    except ValueError as exc:
        raise SuiteError(str(exc)) from None
    return MixedSuite(spec, problems=by_id, split=split)
