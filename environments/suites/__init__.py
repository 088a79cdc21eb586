"""Problem suites as plugins: anything that yields problems, mixed by weight into a campaign's steps.

spec.py      SuiteSpec: one entry of [problems] suites (name, path or entry_point, weight, harness, split)
sources.py   open_suite: the built-in generators, problem folders, manifests, entry points, module:function
manifest.py  JSONL / Parquet manifests: one Problem JSON per line or row, errors naming line and field
split.py     a finite suite's train / validation / held_out parts, and the record a campaign keeps of them
mix.py       SuiteMix: each step's problems apportioned across suites by weight; the held-out problems
check.py     check_suite: each problem well formed, its reference scores 1.0, its start below, in time

    mix = SuiteMix.open([SuiteSpec("mine", path="problems/", weight=2), SuiteSpec.of("repo")],
                        seed=5000, per_step=4)
    mix.step_problems(step=0)
"""

from environments.suites.check import CheckLine, check_problem, check_suite
from environments.suites.manifest import read_manifest
from environments.suites.mix import SuiteMix, apportion
from environments.suites.sources import (
    BUILTIN,
    ENTRY_POINT_GROUP,
    FiniteSuite,
    GeneratedSuite,
    SuiteError,
    installed_suites,
    open_suite,
)
from environments.suites.spec import SuiteSpec
from environments.suites.split import SuiteSplit, record_changes, source_id, split_suite

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "CheckLine",
    "FiniteSuite",
    "GeneratedSuite",
    "SuiteError",
    "SuiteMix",
    "SuiteSpec",
    "SuiteSplit",
    "apportion",
    "check_problem",
    "check_suite",
    "installed_suites",
    "open_suite",
    "read_manifest",
    "record_changes",
    "source_id",
    "split_suite",
]
