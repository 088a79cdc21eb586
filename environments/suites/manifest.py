"""Manifests: a suite as one file, one Problem JSON per line (``.jsonl``) or per row (``.parquet``).

A line (or row) holds the fields of environments.problems.Problem: ``problem_id``, ``instruction``,
``files`` (path -> text) and one grader, ``checks`` (see ``manifest_check``: each ``{"name", "code"}`` in
the check language of a folder's checks.py, or compiled as Problem.to_json writes it) or
``grade_command`` (with ``hidden_tests``) or ``"grader": "pytest"`` (with ``hidden_tests``), plus
any optional field (``solution``, ``visible_test_command``, ``difficulty``, ``meta``, ``harness``,
``grade_timeout_s``); ``suite`` may be left out (the suite's name is set). In Parquet, a structured
field (files, hidden_tests, checks, solution, meta, harness) may be a column of JSON text; a null
is the field's default. Every error names the file, the line (or row) and the field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from environments.problems import Check, Problem
from environments.problems.checks import compile_check

STRUCTURED = {"files": dict, "hidden_tests": dict, "meta": dict, "checks": list, "solution": list}
TEXT = ("problem_id", "instruction")
OPTIONAL_TEXT = ("grade_command", "visible_test_command")


def read_manifest(path: Path) -> tuple[list[Problem], list[str]]:
    """Every valid problem of the manifest and one message per broken line (or row)."""
    if path.suffix == ".parquet":
        records = _parquet_rows(path)
        unit = "row"
    else:
        records = _jsonl_lines(path)
        unit = "line"
    problems, errors, seen = [], [], {}
    for number, record in records:
        where = f"{path} {unit} {number}"
        try:
            if isinstance(record, str):
                raise ValueError(f"{where}: {record}")
            problem = record_problem(record, where)
            if problem.problem_id in seen:
                raise ValueError(
                    f"{where}: problem_id {problem.problem_id!r} is also on {unit} {seen[problem.problem_id]}"
                )
        except ValueError as exc:
            errors.append(str(exc))
            continue
        seen[problem.problem_id] = number
        problems.append(problem)
    return problems, errors


def _jsonl_lines(path: Path) -> list[tuple[int, dict[str, Any] | str]]:
    out: list[tuple[int, dict[str, Any] | str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            out.append((number, f"not valid JSON: {exc}"))
    return out


def _parquet_rows(path: Path) -> list[tuple[int, dict[str, Any] | str]]:
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    return [(number, {k: v for k, v in row.items() if v is not None}) for number, row in enumerate(rows, 1)]


CHECK_SOURCE = ("name", "code")
"""A check as its source: ``code`` in the check language of a folder's checks.py (imports, then
``expect_equal(got, want, what)`` lines; ``expect(condition, message)`` too when it imports nothing)."""
CHECK_COMPILED = tuple(f.name for f in dataclasses.fields(Check))
"""A check as compiled (what Problem.to_json writes): ``name``, ``probe`` (Python that calls
``observe(value)``), ``expected`` (the observed values, in order) and ``imports_workspace``."""


def manifest_check(item: Any, where: str) -> Check:
    """One entry of a manifest's ``checks``, in either form; ValueError names ``where``, the field and
    the fields a check takes."""
    forms = f"a check has {' and '.join(CHECK_SOURCE)}, or {', '.join(CHECK_COMPILED)} (compiled)"
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(item).__name__}; {forms}")
    fields = set(CHECK_SOURCE) if "code" in item else set(CHECK_COMPILED)
    unknown = sorted(set(item) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; {forms}")
    needed = ("name", "code") if "code" in item else ("name", "probe", "expected")
    missing = [name for name in needed if name not in item]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(map(repr, missing))}; {forms}")
    if not isinstance(item["name"], str) or not item["name"]:
        raise ValueError(f"{where}: field 'name' must be a non-empty string")
    if "code" in item:
        if not isinstance(item["code"], str):
            raise ValueError(f"{where}: field 'code' must be a string (check-language source)")
        try:
            return compile_check(item["name"], item["code"])
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    if not isinstance(item["probe"], str) or not isinstance(item["expected"], list):
        raise ValueError(f"{where}: field 'probe' must be a string and 'expected' a JSON array")
    if not isinstance(item.get("imports_workspace", False), bool):
        raise ValueError(f"{where}: field 'imports_workspace' must be true or false")
    return Check(**item)


def record_problem(record: Any, where: str) -> Problem:
    """One manifest record as a Problem; ValueError names ``where`` and the field at fault."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object (a Problem), got {type(record).__name__}")
    known = {f.name for f in dataclasses.fields(Problem)}
    unknown = sorted(set(record) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; a problem has {sorted(known)}")
    data = {"suite": "manifest", "files": {}, **record}
    for name in TEXT:
        if not isinstance(data.get(name), str) or not data[name].strip():
            raise ValueError(f"{where}: field {name!r} is missing or not a non-empty string")
    for name in OPTIONAL_TEXT:
        if data.get(name) is not None and not isinstance(data[name], str):
            raise ValueError(f"{where}: field {name!r} must be a string")
    for name, kind in STRUCTURED.items():
        if name not in data:
            continue
        value = data[name]
        if isinstance(value, str):  # a Parquet column of JSON text
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"{where}: field {name!r} is text but not JSON") from None
        if kind is dict and isinstance(value, list) and all(isinstance(p, tuple | list) for p in value):
            value = dict(value)  # a Parquet map column reads as (key, value) pairs
        if not isinstance(value, kind):
            raise ValueError(
                f"{where}: field {name!r} must be a JSON {'object' if kind is dict else 'array'}"
            )
        data[name] = value
    if "checks" in data:
        data["checks"] = [
            manifest_check(item, f"{where}: checks[{i}]") for i, item in enumerate(data["checks"])
        ]
    for name in ("files", "hidden_tests"):
        for rel, text in data.get(name, {}).items():
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {name!r}: {rel!r} must map to text")
    if "harness" in data and isinstance(data["harness"], str):
        data["harness"] = (
            json.loads(data["harness"]) if data["harness"].startswith("[") else [data["harness"]]
        )
    for name in ("difficulty",):
        if name in data and (isinstance(data[name], bool) or not isinstance(data[name], int)):
            raise ValueError(f"{where}: field {name!r} must be an integer")
    if data.get("grade_timeout_s") is not None and not isinstance(data["grade_timeout_s"], int | float):
        raise ValueError(f"{where}: field 'grade_timeout_s' must be a number of seconds")
    try:
        return Problem.from_json(data)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"{where}: {exc}") from None
