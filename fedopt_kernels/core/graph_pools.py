"""CUDA graph pools and capture checks through torch's public API; its private calls only where checked.

torch >= 2.10 gives a capture its memory pool publicly (``torch.cuda.graph_pool_handle()``, the
``pool`` of ``CUDAGraph.capture_begin`` and of ``torch.cuda.graph``, ``torch.cuda.MemPool``) and says
whether the current stream captures (``torch.cuda.is_current_stream_capturing``). Two things have no
public function:

* the cleanup after a capture the driver invalidated: torch's ``capture_end`` raises before it ends
  the allocator's routing into the capture's pool, and nothing public ends it or releases the pool
  (``torch._C._cuda_endAllocateToPool``, ``_cuda_releasePool``, what ``torch.cuda.use_mem_pool``
  calls on exit);
* the capture check without its Python wrapper (``torch._C._cuda_isCurrentStreamCapturing``), a
  step's hot path.

A private call is used only on the torch versions whose calls were read (``PRIVATE_CHECKED``: the
same arguments as ``use_mem_pool`` passes them) and only when torch has it; on any other torch the
public path runs: the public check, and after a failed capture nothing beyond what torch does
itself (the optimizer then takes eager steps, ``replay.py``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Tuple

import torch
from torch import _C as torch_c

# the first and last torch (major, minor) whose private allocator calls this module's use was read against
PRIVATE_CHECKED: Tuple[Tuple[int, int], Tuple[int, int]] = ((2, 10), (2, 14))


def torch_version(text: Optional[str] = None) -> Tuple[int, int]:
    """(major, minor) of ``text`` (torch's version when None); (0, 0) when it does not parse."""
    m = re.match(r"(\d+)\.(\d+)", str(torch.__version__ if text is None else text))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def private(name: str, version: Optional[Tuple[int, int]] = None) -> Optional[Callable[..., Any]]:
    """``torch._C.<name>`` on a checked torch that has it, else None (take the public path)."""
    low, high = PRIVATE_CHECKED
    if not low <= (torch_version() if version is None else version) <= high:
        return None
    return getattr(torch_c, name, None)


def new_pool() -> Any:
    """A pool id of its own for one capture (public: ``torch.cuda.graph_pool_handle``)."""
    return torch.cuda.graph_pool_handle()


def end_pool(index: int, pool: Any) -> bool:
    """End the allocator's routing into ``pool`` on device ``index``; False when torch had ended it,
    or when this torch is not one the private call was checked on (nothing is done then)."""
    end = private("_cuda_endAllocateToPool")
    if end is None:
        return False
    try:
        end(index, pool)
    except RuntimeError:  # "not currently recording to mempool_id": this torch ended it itself
        return False
    return True


def release_pool(index: int, pool: Any) -> None:
    """Drop a capture's reference to ``pool``, so that its memory can be freed (checked torch only)."""
    release = private("_cuda_releasePool")
    if release is not None:
        release(index, pool)


def stream_capturing() -> Callable[[], bool]:
    """The check "is the current stream capturing?": torch's own C call on a checked torch, its public
    wrapper elsewhere (and on a torch built without CUDA)."""
    fast = private("_cuda_isCurrentStreamCapturing")
    return fast if fast is not None else torch.cuda.is_current_stream_capturing
