"""The one percentile every benchmark reports with (torch-free)."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0 <= q <= 1: 0.5 the median, 0.99 the p99) of ``values``, linear between the
    two nearest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
