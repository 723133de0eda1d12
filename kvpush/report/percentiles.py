# SPDX-License-Identifier: Apache-2.0
"""The one percentile definition every kvpush report and benchmark uses.

Linear interpolation between the closest ranks, numpy's default (method
"linear", Hyndman & Fan type 7): the q-th percentile of n sorted values
sits at position (n - 1) * q / 100, between the values either side of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of values, interpolated linearly between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
