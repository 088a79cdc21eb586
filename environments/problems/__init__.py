"""Problem suites and graders (DESIGN.md section 1: a problem = instruction + workspace template + grader).

base.py      Problem, GradeResult, grading (grade_workspace), reference solutions, the SUITES registry
repo.py      NL2RepoBench-like: write a module from a specification
swe.py       DeepSWE-like: fix planted bugs in a small repository
terminal.py  TerminalBench-like: reach a target file-system state
folder.py    load user-provided problems from disk (instruction.md, workspace/, grade.sh)

from environments.problems import generate, grade_workspace
problems = generate("swe", 8, seed=0, difficulty=2, length=1)
"""

from environments.problems import repo, swe, terminal  # noqa: F401  (importing registers the suites)
from environments.problems.base import (
    SUITES,
    GraderError,
    GradeResult,
    Problem,
    apply_solution,
    generate,
    grade_workspace,
    parse_grade_output,
    write_workspace,
)
from environments.problems.folder import FolderLoad, load_folder, read_folder

__all__ = [
    "SUITES",
    "FolderLoad",
    "GradeResult",
    "GraderError",
    "Problem",
    "apply_solution",
    "generate",
    "grade_workspace",
    "load_folder",
    "parse_grade_output",
    "read_folder",
    "write_workspace",
]
