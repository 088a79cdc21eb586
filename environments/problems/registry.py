"""The registry of generated problem suites, stable problem ids, and the vocabulary suites share.

The suites (repo.py, swe.py, terminal.py) register a generator under their name at import;
``generate(suite, n, ...)`` calls it. The same arguments always give the same problems: every
problem's ``random.Random`` is seeded with its own id (string seeds are stable across runs).
A campaign reaches these generators as plugins (environments/suites/sources.py: the ``gyrerl.suites``
entry points), beside folders, manifests and other packages' suites.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from environments.problems.problem import Problem

SuiteGenerator = Callable[..., list[Problem]]
SUITES: dict[str, SuiteGenerator] = {}
"""suite name -> generator(n, *, seed, difficulty, length); filled by the suite modules at import."""


def register_suite(name: str) -> Callable[[SuiteGenerator], SuiteGenerator]:
    def register(generator: SuiteGenerator) -> SuiteGenerator:
        if name in SUITES:
            raise ValueError(f"suite {name!r} is registered twice")
        SUITES[name] = generator
        return generator

    return register


def generate(suite: str, n: int, *, seed: int = 0, difficulty: int = 1, length: int = 1) -> list[Problem]:
    """``n`` problems of a suite; the same arguments always give the same problems.

    difficulty: how many required items (files to change, functions to write, bugs to fix) and how
    many distracting files; length: how much text each item carries (lines, expression size, module
    size). Both start at 1.
    """
    if suite not in SUITES:
        raise ValueError(f"unknown problem suite {suite!r}; known suites: {sorted(SUITES)}")
    if n < 0 or difficulty < 1 or length < 1:
        raise ValueError(f"need n >= 0, difficulty >= 1 and length >= 1; got n={n}, {difficulty=}, {length=}")
    return SUITES[suite](n, seed=seed, difficulty=difficulty, length=length)


def problem_id(suite: str, seed: int, difficulty: int, length: int, index: int) -> str:
    """Stable id, distinct for every (suite, seed, difficulty, length, index); it also seeds the
    problem's ``random.Random``."""
    return f"{suite}-s{seed}-d{difficulty}l{length}-{index:03d}"


def action(tool: str, **arguments: Any) -> dict[str, Any]:
    """One solution step in the harness's shape: ``{"tool": tool, "arguments": {...}}``."""
    return {"tool": tool, "arguments": arguments}


WORDS = (
    "apple", "river", "stone", "cloud", "paper", "green", "quick", "silver", "garden", "window",
    "orange", "market", "pencil", "rocket", "winter", "summer", "castle", "forest", "candle", "bridge",
    "yellow", "butter", "engine", "planet", "spring", "ticket", "violet", "wallet", "dragon", "letter",
)  # fmt: skip
NOISE_DIRS = ("misc", "old", "drafts", "archive", "scratch")


def words(rng: random.Random, count: int) -> str:
    """``count`` random vocabulary words joined by spaces (plain ASCII, no shell-special characters)."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


def noise_files(rng: random.Random, count: int, taken: set[str]) -> dict[str, str]:
    """``count`` distracting text files at paths not in ``taken`` (which is updated)."""
    files: dict[str, str] = {}
    while len(files) < count:
        path = f"{rng.choice(NOISE_DIRS)}/{rng.choice(WORDS)}_{rng.randint(1, 99)}.txt"
        if path in taken:
            continue
        taken.add(path)
        files[path] = "\n".join(words(rng, rng.randint(2, 5)) for _ in range(rng.randint(1, 3))) + "\n"
    return files
