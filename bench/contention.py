"""How much CPU other processes used while a case ran (Linux /proc), to flag disturbed CPU timings.

On a shared machine a compiler or a test suite on the same cores slows the timed step, and
OpenMP-parallel kernels can slow down by orders of magnitude when their threads are descheduled.
``OtherLoad`` measures busy CPU time of the whole machine minus this process's own, per wall
second: 0.0 means the cores were ours alone; 1.0 means another process kept one core busy.
"""

from __future__ import annotations

import os
import time
from typing import Optional, Tuple

# cores used by other processes during a CPU case above which its figures count as disturbed
DISTURBED = 0.25

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _sample() -> Optional[Tuple[float, float, float]]:
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(cpu) - cpu[3] - (cpu[4] if len(cpu) > 4 else 0)  # all but idle and iowait
    own = int(fields[11]) + int(fields[12])  # utime + stime of every thread
    return time.perf_counter(), busy / _HZ, own / _HZ


class OtherLoad:
    """``with OtherLoad() as o: ...`` then ``o.cores``: mean cores other processes kept busy (None off Linux)."""

    def __init__(self) -> None:
        self.cores: Optional[float] = None
        self._start: Optional[Tuple[float, float, float]] = None

    def __enter__(self) -> OtherLoad:
        self._start = _sample()
        return self

    def __exit__(self, *exc) -> None:
        end = _sample()
        if self._start is None or end is None:
            return
        wall = end[0] - self._start[0]
        if wall > 0:
            self.cores = max(0.0, ((end[1] - self._start[1]) - (end[2] - self._start[2])) / wall)


def wait_quiet(max_wait_s: float, threshold: float = DISTURBED, window_s: float = 10.0) -> Optional[float]:
    """Wait until other processes used < ``threshold`` cores over a ``window_s`` window, for at
    most ``max_wait_s`` seconds; return the last window's figure (None where unmeasurable)."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        with OtherLoad() as o:
            time.sleep(window_s)
        if o.cores is None or o.cores < threshold or time.perf_counter() >= deadline:
            return o.cores
