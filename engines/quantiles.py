"""The quantile every figure of the project uses (the gateway's overhead in /admin/stats, the benchmarks'
latencies): nearest rank on sorted values, so a figure is always one of the measured values."""

from __future__ import annotations

from collections.abc import Sequence


def quantile(sorted_values: Sequence[float], q: float, digits: int | None = None) -> float | None:
    """The value at rank round(q * (n - 1)) of ``sorted_values`` (ascending), rounded to ``digits`` when
    given; None when there are none."""
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    value = sorted_values[index]
    return value if digits is None else round(value, digits)
