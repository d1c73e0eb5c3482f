"""Which backends the tests run on this machine: every registered backend usable on a device."""

from __future__ import annotations

from typing import Any, List, Optional

import pytest
import torch

from fedopt_kernels.core import registry as _registry

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def usable(device: str = "cpu") -> List[str]:
    """Backends (reference first) that can run on ``device`` here."""
    return [b for b in _registry.BACKENDS if _registry.unavailable_reason(b, torch.device(device)) is None]


def cases(with_reference: bool = True) -> List[Any]:
    """(backend, device) pairs for parametrize; unusable pairs are kept and skipped with the reason."""
    out = []
    for device in DEVICES:
        for b in _registry.BACKENDS:
            if b == "reference" and not with_reference:
                continue
            out.append(pytest.param(b, device, id=f"{b}-{device}"))
    return out


def require(backend: str, device: str = "cpu", dtype: Optional[torch.dtype] = None) -> None:
    """Skip unless ``backend`` runs on ``device`` here (and takes ``dtype``, when given)."""
    why = _registry.unavailable_reason(backend, torch.device(device))
    if why is not None:
        pytest.skip(why)
    if dtype is not None and not supports(backend, dtype):
        pytest.skip(f"{backend} does not take {dtype}")


def supports(backend: str, dtype: torch.dtype) -> bool:
    """triton takes float32/bfloat16/float16 only (float64 is refused with a TypeError)."""
    return not (backend == "triton" and dtype == torch.float64)


def grad_scaler_unscales(device: str, dtype: torch.dtype) -> Optional[str]:
    """None when torch's GradScaler can unscale ``dtype`` gradients on ``device``; else why not.

    Feature-tested, not looked up by version: torch 2.11's CUDA kernel behind
    ``GradScaler.unscale_`` has no bfloat16 case (torch's own optimizers hit the same error).
    """
    found = torch.zeros(1, device=device)
    inv = torch.ones(1, device=device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(2, dtype=dtype, device=device)], found, inv)
    except (NotImplementedError, RuntimeError) as exc:
        return f"torch {torch.__version__} cannot unscale {dtype} gradients on {device} ({exc})"
    return None
