"""Small helpers shared by the reference ops."""
from __future__ import annotations

from typing import Iterable

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for float64 tensors, float32 otherwise (SPEC §7: math in float32)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def up(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its compute dtype (a copy only when the dtype changes)."""
    return t.to(compute_dtype(t))


def norm_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """Global norms accumulate in float64 when any tensor is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def global_norm(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """L2 norm over all ``tensors`` as ``clip_grad_norm_`` computes it: norm of the per-tensor norms."""
    if not tensors:
        return torch.zeros((), dtype=dtype, device=device)
    norms = [torch.linalg.vector_norm(t.to(dtype)) for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms))
