"""Problem suites and graders (DESIGN.md section 1: a problem = instruction + workspace template + grader).

problem.py   Problem (and the PublicProblem a harness sees), Check, writing templates, reference solutions
checks.py    the check language: hidden checks (probe + expected values) and visible test scripts
grading.py   grade_workspace: probes judged outside the sandbox, the built-in pytest grader, or a grade command
grading_copy.py  the grading copy: only what the agent may change, special files skipped, bytes budgeted
pytest_grader.py the built-in pytest grader: a runner outside the workspace, outcomes per hidden test id
registry.py  the SUITES registry, generate(), stable problem ids, shared vocabulary
repo.py      NL2RepoBench-like: write a module from a specification
swe.py       DeepSWE-like: fix planted bugs in a small repository
terminal.py  TerminalBench-like: reach a target file-system state
folder.py    load user-provided problems from disk (instruction.md, workspace/, tests/, solution/, ...);
             environments/suites/ turns folders, manifests and plugins into a campaign's suites

from environments.problems import generate, grade_workspace
problems = generate("swe", 8, seed=0, difficulty=2, length=1)
"""

from environments.problems import repo, swe, terminal  # noqa: F401  (importing registers the suites)
from environments.problems.folder import FolderLoad, load_folder, read_folder
from environments.problems.grading import GraderError, GradeResult, grade_workspace, parse_grade_output
from environments.problems.problem import (
    TOOL_NAMES,
    Check,
    Problem,
    PublicProblem,
    SolutionError,
    apply_solution,
    write_workspace,
)
from environments.problems.registry import SUITES, generate

__all__ = [
    "SUITES",
    "TOOL_NAMES",
    "Check",
    "FolderLoad",
    "GradeResult",
    "GraderError",
    "Problem",
    "PublicProblem",
    "SolutionError",
    "apply_solution",
    "generate",
    "grade_workspace",
    "load_folder",
    "parse_grade_output",
    "read_folder",
    "write_workspace",
]
