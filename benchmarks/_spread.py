"""How the benchmarks report a cell measured several times: each value, the median, the range."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["spread"]


def spread(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Each repetition's value, their median and their range, rounded to ``digits``."""
    return {
        "values": [round(v, digits) for v in values],
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }
