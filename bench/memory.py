"""Memory figures of an optimizer: its state, and the extra memory one step allocates.

- ``state_bytes``: bytes of every tensor in ``optimizer.state`` (momentum buffers, control
  variates, accumulators, anchors...), exact on any device.
- ``step_peak_bytes``: the peak of memory allocated during one step above what was allocated
  before it (temporaries, plus state created lazily on that step). CUDA: from
  ``torch.cuda.max_memory_allocated``. CPU: tracemalloc cannot see torch's allocator and the
  resident set hides reused heap pages, so this replays the step under ``torch.profiler`` with
  ``profile_memory=True`` and sums the allocator's alloc/free events in time order (allocations
  torch does not make, e.g. a C++ ``std::vector`` in an extension, are not seen).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional

import torch

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler's log lines out of the report


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence fd 2 (kineto prints start/stop lines from C++ that Python cannot catch)."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def step_peak_bytes(step: Callable[[], None], device: torch.device) -> Optional[int]:
    """Peak extra bytes allocated while ``step()`` runs once (module docstring); None if unmeasurable."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    try:
        from torch.profiler import ProfilerActivity, profile

        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = [
            e
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ]
    except Exception:  # profiler unavailable or changed: say n/a rather than guess
        return None
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak
