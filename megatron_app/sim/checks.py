"""Validation of numeric simulator options: one clear ScheduleConfigError line per bad value."""

from __future__ import annotations

import math
from typing import Optional

from megatron_app.schedule import ScheduleConfigError


def check_number(name: str, value, minimum: float, inclusive: bool = True, maximum: Optional[float] = None,
                 max_inclusive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ScheduleConfigError(f"{name} must be a finite number, got {value!r}")
    low_ok = value >= minimum if inclusive else value > minimum
    high_ok = maximum is None or (value <= maximum if max_inclusive else value < maximum)
    if not (low_ok and high_ok):
        low = f"{'>=' if inclusive else '>'} {minimum:g}"
        high = "" if maximum is None else f" and {'<=' if max_inclusive else '<'} {maximum:g}"
        raise ScheduleConfigError(f"{name} must be {low}{high}, got {value!r}")
    return float(value)
