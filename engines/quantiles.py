"""The quantile every latency figure uses (p50, p95, p99 of a run's measurements), defined once.

    quantile([0.3, 0.1, 0.2], 0.5)   # 0.2
    quantile([], 0.99)               # None: no measurement, no figure

Nearest rank: the value at index round(q * (n - 1)) of the sorted values, so a quantile is always a
measured value (never an interpolation between two).
"""

from __future__ import annotations

from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile (0 <= q <= 1) of ``values`` by nearest rank; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]
