"""Peak memory of a client-batched round: CUDA's allocator statistics, or on a CPU the bytes glibc's
malloc has in use, read after every operator (torch's CPU allocator hands freed blocks straight back
to malloc)."""

from __future__ import annotations

import ctypes
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo() -> Optional[Callable[[], int]]:
    """Bytes glibc's malloc has in use (main arena + mmapped), or None off glibc >= 2.33."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def in_use() -> int:
        m = fn()
        return int(m.uordblks + m.hblkhd)

    return in_use


class PeakMemory(TorchDispatchMode):
    """Peak bytes in use while it is active, above what was in use when it started: CUDA's allocator
    statistics, or on a CPU malloc's in-use bytes read after every operator (forward and backward)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.host = _mallinfo() if device.type == "cpu" else None
        self.base = self.top = 0
        self.peak: Optional[int] = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        if self.host is not None:
            self.base = self.top = self.host()
            return super().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            return None
        if self.host is not None:
            super().__exit__(*exc)
            self.peak = self.top - self.base
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.top = max(self.top, self.host())  # set whenever the mode is entered
        return out
