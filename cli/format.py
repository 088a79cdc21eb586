"""Console output: query results as an aligned table (rich), CSV or JSON, and rows printed one at a
time under a header as work finishes.

    print(render(["step", "reward"], [[0, 0.25], [1, 0.5]]))           # header, a rule, rows, (2 rows)
    rows = Rows([("execution", 40), ("reward", -6)], file=sys.stdout)   # negative width: right-aligned
    rows.header(); rows.add(["s0-p-g0", "1.00"])

Tables are drawn by rich (plain text, no colour, ASCII rule under the header), so the output reads
the same in a terminal, a pipe or a log; `--format json` and `--format csv` are machine-readable and
never go through rich.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from typing import IO, Any

from rich.box import Box
from rich.console import Console
from rich.table import Table
from rich.text import Text

MAX_CELL = 60
WIDE = 10_000  # a table is never wrapped to the terminal: a pipe gets every column whole

HEAD_RULE = Box(
    "    \n    \n -- \n    \n    \n    \n    \n    \n", ascii=True
)  # a rule under the header only


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 3] + "..."


def _text(table: Table | Text) -> list[str]:
    console = Console(file=io.StringIO(), width=WIDE, color_system=None, highlight=False)
    console.print(table)
    return [line.rstrip() for line in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table") -> str:
    if fmt == "json":
        return json.dumps([dict(zip(columns, row, strict=True)) for row in rows], indent=1, default=str)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
        return out.getvalue().rstrip("\n")
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}; expected table, csv or json")
    table = Table(box=HEAD_RULE, show_edge=False, pad_edge=False, highlight=False)
    for i, name in enumerate(columns):
        numeric = all(isinstance(row[i], int | float) or row[i] is None for row in rows)
        table.add_column(Text(name), justify="right" if numeric else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(_cell(v)) for v in row))
    lines = _text(table)
    if not rows:  # rich draws no rule under a header without rows
        lines = [lines[0], "-" * len(lines[0])] if lines else []
    return "\n".join([*lines, f"({len(rows)} row{'s' if len(rows) != 1 else ''})"])


class Rows:
    """Rows printed one at a time under a header, each column ``width`` wide (negative: right-aligned),
    as a rich grid; a value longer than its column widens it for its row (a row is never wrapped)."""

    def __init__(self, columns: Sequence[tuple[str, int]], file: IO[str]):
        self.columns, self.file = columns, file

    def _print(self, values: Sequence[str], note: str = "") -> None:
        grid = Table.grid(padding=(0, 1, 0, 0))
        for (_, width), value in zip(self.columns, values, strict=True):
            grid.add_column(width=max(abs(width), len(value)), justify="right" if width < 0 else "left")
        grid.add_row(*(Text(v) for v in values))
        line = _text(grid)[0]
        print(line + (f"  ({note})" if note else ""), file=self.file, flush=True)

    def header(self) -> None:
        self._print([name for name, _ in self.columns])

    def add(self, values: Sequence[Any], note: str = "") -> None:
        self._print([_cell(v) if not isinstance(v, str) else v for v in values], note)
