"""A block in which any CUDA call that makes the host wait for the device raises (``step()`` never may)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Wait for the device first (earlier work is not what is checked), then raise on any synchronisation."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
