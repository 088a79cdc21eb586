"""Which problems a campaign trains on and evaluates: ProblemsConfig ([problems]), EvaluationConfig
([evaluation]), and the problems of a step and of the held-out evaluation.

    problems = step_problems(config.problems, step=3, round=0)        # the same every time
    held = held_out_problems(config.evaluation, config.problems)

No Prefect here (tasks/campaign.py's ``choose_problems`` task wraps ``step_problems``), so a campaign
config is read, and its suites checked (`gyre run --check`), without starting anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, field_validator, model_validator

from environments.problems import Problem, generate
from environments.suites import (
    BUILTIN,
    GeneratedSuite,
    SuiteError,
    SuiteMix,
    SuiteSpec,
    SuiteSplit,
    open_suite,
    split_suite,
)

_SUITE_SPEC = TypeAdapter(SuiteSpec)


class ProblemsConfig(BaseModel):
    """Which problems a step trains on (groups of dispatch.group_size executions each)."""

    suites: list[str | SuiteSpec] = Field(
        default_factory=lambda: ["repo"],
        description="the problem suites: a name (a built-in generator: repo, swe, terminal, or an installed "
        "suite) or a table { name, path, entry_point, weight, harness, held_out, validation } "
        "(environments/suites/spec.py SuiteSpec); generated suites named alone are taken round-robin, any "
        "other mix is apportioned by weight",
        min_length=1,
    )
    difficulty: int = Field(
        1,
        ge=1,
        description="how many required items a problem has (files to change, functions to write, bugs to "
        "fix) and how many distracting files",
    )
    length: int = Field(
        1, ge=1, description="how much text each item carries (lines, expression size, module size)"
    )
    per_step: int = Field(4, ge=1, description="problems (groups) per step")
    seed: int = Field(
        5000,
        description="step n draws its problems from generator seed seed + n; keep it away from the "
        "held-out evaluation's seed and from the warm start's (0-999 held out, 1000+ trained)",
    )
    zero_signal: Literal["skip", "top_up", "keep"] = Field(
        "skip",
        description="groups whose rewards are all equal carry no signal: skip them; top the step up with "
        "more problems while some group has none (at most top_up_rounds rounds of per_step problems), "
        "then skip those left; or keep them (advantage 0, they count in the loss's average)",
    )
    top_up_rounds: int = Field(
        1, ge=0, description='rounds of per_step more problems at most, with zero_signal = "top_up"'
    )
    pool: int = Field(
        0,
        ge=0,
        description="0: every step draws fresh problems (generator seed seed + n); N > 0: a fixed pool of "
        "N problems from generator seed seed, which the steps go through in turn, per_step at a time (epochs "
        "over a dataset; with pool = per_step, every step trains on the same problems)",
    )

    @field_validator("suites", mode="before")
    @classmethod
    def _suite_tables(cls, value: Any) -> Any:
        """A table becomes a SuiteSpec here, so an error names the suite and the key (not pydantic's
        two attempts at ``str | SuiteSpec``); a misspelt key is refused, not dropped."""
        if not isinstance(value, list):
            return value
        known = [f.name for f in dataclasses.fields(SuiteSpec)]
        specs = []
        for entry in value:
            if not isinstance(entry, dict):
                specs.append(entry)
                continue
            name = entry.get("name", "?")
            unknown = sorted(set(entry) - set(known))
            if unknown:
                raise ValueError(f"suite {name}: unknown key(s) {unknown}; a suite has {', '.join(known)}")
            try:
                specs.append(_SUITE_SPEC.validate_python(entry))
            except ValidationError as exc:
                wrong = "; ".join(
                    ".".join(map(str, e["loc"])) + ": " + e["msg"] if e["loc"] else e["msg"]
                    for e in exc.errors()
                ).replace("Value error, ", "")
                raise ValueError(wrong if wrong.startswith("suite ") else f"suite {name}: {wrong}") from None
        return specs

    @model_validator(mode="after")
    def _unique_suite_names(self) -> ProblemsConfig:
        names = self.suite_names
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"suites {doubled} appear more than once; each suite needs a name of its own")
        return self

    @property
    def suite_names(self) -> list[str]:
        return [SuiteSpec.of(s).name for s in self.suites]

    @property
    def round_robin(self) -> bool:
        """Only built-in generators, named alone: taken round-robin, as campaigns always did (a resumed
        campaign chooses the problems it chose before)."""
        return all(isinstance(s, str) and s in BUILTIN for s in self.suites)

    def relative_to(self, base: str | Path) -> ProblemsConfig:
        """A copy whose suites' relative paths are taken from ``base`` (the campaign config's folder)."""
        suites = [s.relative_to(base) if isinstance(s, SuiteSpec) else s for s in self.suites]
        return self.model_copy(update={"suites": suites})

    @model_validator(mode="after")
    def _pool_holds_a_step(self) -> ProblemsConfig:
        rounds = 1 + (self.top_up_rounds if self.zero_signal == "top_up" else 0)
        if self.pool and self.pool < self.per_step * rounds:
            raise ValueError(
                f"problems.pool = {self.pool} is smaller than one step's problems ({self.per_step} per round x "
                f"{rounds} round(s)): a step would run the same problem twice"
            )
        return self


class EvaluationConfig(BaseModel):
    """The held-out evaluation: at the start, every `every` steps and at the end."""

    every: int = Field(0, ge=0, description="evaluate every this many steps (0: at the start and the end)")
    per_suite: int = Field(8, ge=1, description="held-out problems per suite")
    seed: int = Field(0, description="generator seed of the held-out problems")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of the evaluation (0: greedy)")
    samples: int = Field(
        1,
        ge=1,
        description="executions per held-out problem (more than 1 only makes sense with temperature > 0)",
    )

    def due(self, version: int, steps: int) -> bool:
        """Whether ``version`` (made by step ``version - 1``) is evaluated: every ``every`` and the last."""
        return version == steps or bool(self.every and version % self.every == 0)


# -- problems --------------------------------------------------------------------------------


def problems_for(
    suites: list[str], n: int, seed: int, difficulty: int, length: int, skip: int = 0
) -> list[Problem]:
    """``n`` problems round-robin over ``suites`` from generator ``seed``, after the first ``skip``."""
    per_suite = -(-(skip + n) // len(suites))
    pools = [generate(s, per_suite, seed=seed, difficulty=difficulty, length=length) for s in suites]
    ordered = [pools[i % len(pools)][i // len(pools)] for i in range(per_suite * len(pools))]
    return ordered[skip : skip + n]


def suite_mix(config: ProblemsConfig) -> SuiteMix:
    """The suites of ``config``, opened and split (environments/suites/mix.py)."""
    rounds = 1 + (config.top_up_rounds if config.zero_signal == "top_up" else 0)
    return SuiteMix.open(
        [SuiteSpec.of(s) for s in config.suites],
        seed=config.seed,
        per_step=config.per_step,
        rounds=rounds,
        difficulty=config.difficulty,
        length=config.length,
        pool=config.pool,
    )


def step_problems(config: ProblemsConfig, step: int, round: int = 0) -> list[dict[str, Any]]:
    """The problems of round ``round`` of step ``step`` (as Problem JSON): derived from (seed, step,
    round) alone, so the same every time."""
    if not config.round_robin:
        return [p.to_json() for p in suite_mix(config).step_problems(step, round)]
    if config.pool:
        pool = problems_for(list(config.suites), config.pool, config.seed, config.difficulty, config.length)
        start = step * config.per_step + round * config.per_step
        return [pool[(start + i) % config.pool].to_json() for i in range(config.per_step)]
    chosen = problems_for(
        list(config.suites),
        config.per_step,
        config.seed + step,
        config.difficulty,
        config.length,
        skip=round * config.per_step,
    )
    return [p.to_json() for p in chosen]


def held_out_problems(config: EvaluationConfig, problems: ProblemsConfig) -> list[dict[str, Any]]:
    """Generated suites: ``per_suite`` problems from the evaluation's seed; finite suites: their
    held_out part (at most ``per_suite``)."""
    if not problems.round_robin:
        return [p.to_json() for p in suite_mix(problems).held_out(config.per_suite, config.seed)]
    return [
        p.to_json()
        for suite in problems.suites
        for p in generate(
            suite, config.per_suite, seed=config.seed, difficulty=problems.difficulty, length=problems.length
        )
    ]


# -- checked before a campaign starts (`gyre run --check`) -----------------------------------


@dataclass
class CheckReport:
    """What a check found: a line per thing checked, every error (not only the first) and what the
    user should know (a suite never evaluated)."""

    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    held_out: int = 0
    """problems of each held-out evaluation (0: evaluation is off)"""


def check_suites(problems: ProblemsConfig, evaluation: EvaluationConfig) -> CheckReport:
    """Opens and splits every suite: a missing path, a broken problem, a held_out or validation id
    that names no problem (the error lists the ids the suite has), a suite too small for its share of
    a step are errors; a finite suite with no held-out problem, never evaluated, is a warning."""
    check = CheckReport()
    never_evaluated = []  # finite suites with no held-out problem
    for entry in problems.suites:
        spec = SuiteSpec.of(entry)
        try:
            opened = open_suite(spec)
        except SuiteError as exc:
            check.errors.append(str(exc))
            continue
        if isinstance(opened, GeneratedSuite):
            check.lines.append(
                f"suite {spec.name}: generated; held out: {evaluation.per_suite} problem(s) a version "
                f"(generator seed {evaluation.seed})"
            )
            continue
        check.errors += [f"suite {spec.name}: {error}" for error in opened.errors]
        if not opened.problems:
            check.errors.append(f"suite {spec.name} has no problems ({spec.path or spec.entry_point})")
            continue
        try:
            split = split_suite(spec.name, opened.problems, spec.held_out, spec.validation)
        except ValueError as exc:
            check.errors.append(str(exc))
            continue
        check.lines.append(_split_line(spec, split, evaluation.per_suite))
        if not split.held_out:
            never_evaluated.append(spec.name)
    if check.errors:
        return check
    try:
        check.held_out = len(held_out_problems(evaluation, problems))
    except SuiteError as exc:  # what only the mix sees: a suite too small for its share of a step
        check.errors.append(str(exc))
        return check
    if not check.held_out:
        check.warnings.append(
            "evaluation is off: no problem of any suite is held out, so no version is evaluated "
            "(give a suite held_out = [ids] or a fraction)"
        )
        return check
    for name in never_evaluated:
        check.warnings.append(
            f"suite {name}: no problem is held out, so it is never evaluated (give it held_out = [ids] "
            "or a fraction)"
        )
    return check


def _split_line(spec: SuiteSpec, split: SuiteSplit, per_suite: int) -> str:
    parts = [f"{len(split.train)} to train"]
    if split.validation:
        parts.append(f"{len(split.validation)} for validation")
    if split.held_out:
        held = split.held_out[:per_suite]
        more = (
            f" (the first {per_suite} of {len(split.held_out)}: [evaluation] per_suite)"
            if len(split.held_out) > per_suite
            else ""
        )
        parts.append(f"held out: {', '.join(held)}{more}")
    size = len(split.train) + len(split.validation) + len(split.held_out)
    return f"suite {spec.name}: {size} problems, {'; '.join(parts)}"
