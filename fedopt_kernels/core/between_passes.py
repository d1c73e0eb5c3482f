"""The cross-rank reduction a norm op makes between its two passes, set per op call on this thread.

Sharded parameters (``dtensor.py``) need the global norm over every rank: around one op call,
``reducing(reduce)`` makes ``current.reduce`` the function the backend calls with its pass-1 sums.
What ``reduce`` takes is each backend's: the reference backend hands its float64 sums per tensor
and uses the total returned; the Triton backend hands its float64 norm slots, which ``reduce``
rewrites in place. One op call runs one backend, so one slot serves both.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

current = threading.local()


@contextmanager
def reducing(reduce: Callable) -> Iterator[None]:
    """Within the block, this thread's norm ops call ``reduce`` between their passes."""
    saved = getattr(current, "reduce", None)
    current.reduce = reduce
    try:
        yield
    finally:
        current.reduce = saved
