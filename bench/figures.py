"""Where every benchmark's figures go: JSON under bench/results/ (STYLE.md: every benchmark prints its
figures and writes them; every figure in the README comes from such a file)."""

from __future__ import annotations

import json
import os
from typing import Any


def write_figures(figures: dict[str, Any], out: str, *, indent: int = 1) -> None:
    """Writes ``figures`` as JSON to ``out`` (its folder made if needed) and says where."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as handle:
        json.dump(figures, handle, indent=indent)
    print(f"wrote {out}")
