"""Keep freed host memory in the process: stacked clients' tensors are past glibc's mmap ceiling.

glibc's ``malloc`` serves blocks above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and unmaps them on ``free``; the next block of that size is page-faulted in again, page by page,
with the kernel zeroing every page. A client-batched step allocates tensors of C times a client's
size (a FedAvg CNN's first linear layer: 6.4 MB per client, 128 MB for C = 20) at every step, so it
paid that on every gradient: 27% of the CPU time of a FedAvg-CNN step at C = 20 on a 2-core AMD
EPYC (docs/client_batched.md). ``keep_freed_memory`` turns mmap off for ``malloc`` and raises the
trim threshold, so freed blocks stay in the heap and the next step reuses them: what caching
allocators (jemalloc, tcmalloc, PyTorch's CUDA allocator) do. The process keeps its peak memory
instead of returning it to the system.

It changes the whole process, so it is called only where the simulator trains clients
client-batched on a CPU (``sim.batched_round``) and by the client-batched benchmark; elsewhere
(macOS, musl, Windows) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_done = False


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory (module docstring); True if it is in effect."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu = ctypes.CDLL(None).gnu_get_libc_version  # glibc only (musl has mallopt as a no-op)
    except (OSError, AttributeError):
        return False
    del gnu
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _done = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    return _done
