"""The quantile every latency figure uses (the gateway's overhead in /admin/stats, the scheduler's switch
p50, the benchmarks' p50/p95/p99), defined once.

    quantile([0.3, 0.1, 0.2], 0.5)   # 0.2
    quantile([], 0.99)               # None: no measurement, no figure

Nearest rank: the value at index round(q * (n - 1)) of the sorted values, so a quantile is always a
measured value (never an interpolation between two).
"""

from __future__ import annotations

from collections.abc import Iterable


def quantile(values: Iterable[float], q: float, digits: int | None = None) -> float | None:
    """The ``q`` quantile (0 <= q <= 1) of ``values`` by nearest rank, rounded to ``digits`` when given;
    None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    value = ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
    return value if digits is None else round(value, digits)
