"""Peak memory an optimizer adds while it steps (state plus temporaries), per device.

CUDA: ``torch.cuda.max_memory_allocated`` over the allocation at the start.
CPU: tracemalloc cannot see torch's allocations, so this reads the process's resident set:
the kernel's peak RSS (``VmHWM``) is reset through ``/proc/self/clear_refs`` and compared with
the RSS at the start. Freed-but-cached heap pages are not counted as growth, so this is a lower
bound; where ``/proc`` does not allow it the figure is None (reported as n/a).
"""
from __future__ import annotations

from typing import Optional

import torch


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes`` (None when not measurable)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes: Optional[int] = None
        self.method = "n/a"
        self._base = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "cuda max_memory_allocated"
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # 5: reset the peak resident set size to the current one
                rss = _status_kib("VmRSS")
                if rss is not None:
                    self._base = rss * 1024
                    self.method = "peak RSS growth (VmHWM after clear_refs)"
            except OSError:
                self.method = "n/a"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self.method != "n/a":
            hwm = _status_kib("VmHWM")
            self.peak_bytes = None if hwm is None else max(0, hwm * 1024 - self._base)
