"""The ``cuda`` backend: CUDA kernels of ``csrc/cuda`` (extension ``fedopt_kernels._C_cuda``).

Multi-tensor launches (one per pass and parameter dtype over all tensors), 128-bit vector access
for float32, float32 math for float16/bfloat16, a deterministic two-phase global norm in float64,
and every per-step scalar (hp, lr_k, norm, clip/normalisation factor, GradScaler's factor) read or
computed on the device, so ``step()`` never synchronises with the host and can be captured in a
CUDA graph.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ..impl_table import AbsentHere, register_device_check
from ._native import load_extension, register_extension


def _no_use_here() -> Optional[str]:
    """Why this machine has no use for CUDA kernels, or None where a GPU is visible."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build, as installed for a machine without a GPU"
    if not torch.cuda.is_available():
        return "no GPU is visible, as expected on a CPU-only machine (FEDOPT_BUILD_CUDA=1 at install builds it anyway)"
    return None


try:
    _C = load_extension("_C_cuda")
except ImportError as exc:
    # without a GPU a missing extension is the expected outcome, unless a build of it was tried and failed
    _why = _no_use_here()
    if _why is None or "build failed" in str(exc) or "configuration failed" in str(exc):
        raise
    raise AbsentHere(f"not built here: {_why}") from exc
extension = _C  # the compiled module, as the cpu backend names it (core/clip_sum.py calls clip_sum)
_checked: Dict[int, Optional[str]] = {}


def _device_check(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"the cuda backend runs on CUDA tensors only, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available (no GPU visible, or torch was built without CUDA)"
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _checked:
        _checked[index] = _C.device_unsupported(index) or None
    return _checked[index]


register_device_check("cuda", _device_check)
register_extension(_C, "cuda")
