"""The checks of a strategy's arguments: a clear error naming the parameter, before anything is built."""

from __future__ import annotations

import math
from typing import Optional


def check_fraction(name: str, value: float, allow_zero: bool) -> None:
    """ValueError naming ``name`` unless ``value`` is a number in [0, 1] (``(0, 1]`` unless ``allow_zero``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > 1 or value < 0 or (value == 0 and not allow_zero):
        lo = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a number {lo} and <= 1, got {value!r}")


def check_count(name: str, value: Optional[int], optional: bool = True) -> None:
    """ValueError naming ``name`` unless ``value`` is an integer >= 1 (or None where ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1{' or None' if optional else ''}, got {value!r}")
