"""The one test of "a real, finite number" that the load-time checks share (no imports: any validator may use it)."""

from __future__ import annotations

import math


def finite_number(v) -> bool:
    """An int or float (not a bool) that is finite: NaN passes every `v > 0` test and inf every `v >= 0`."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
