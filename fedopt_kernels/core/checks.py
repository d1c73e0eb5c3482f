"""Validators the optimizers share: numbers, tensor learning rates, per-parameter tensor lists, and
the memory a parameter may touch (docs/algorithms.md, "Bad input": an error names the parameter or
hyperparameter, and a rejected call changes nothing).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from . import dtensor as _dtensor


def check_lr_tensor(lr: torch.Tensor, device: Optional[torch.device], *, read_value: bool) -> None:
    """Check a tensor learning rate (docs/torch_optim.md); its value only when ``read_value``.

    The value check reads the tensor back (a host sync for a device tensor), so the caller asks
    for it only outside ``step()`` or for CPU tensors.
    """
    if lr.numel() != 1:
        # torch.optim's wording first (its generic optimizer tests match it), then ours
        raise ValueError(
            f"Tensor lr must be 1-element: lr must be a number or a tensor with one element "
            f"(0-d), got a tensor of shape {tuple(lr.shape)}"
        )
    if not lr.is_floating_point() or lr.is_complex():
        # an integer tensor would truncate what a scheduler writes into it with fill_
        raise TypeError(f"lr tensor must have a real floating-point dtype, got {lr.dtype}")
    if lr.device.type != "cpu" and device is not None and lr.device != device:
        raise ValueError(f"lr tensor is on {lr.device}; it must be on the CPU or on the parameters' device ({device})")
    if read_value:
        v = float(lr.detach().reshape(()).double())
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"lr must be finite, got {v!r} (tensor)")
        if v < 0:
            raise ValueError(f"lr must be >= 0.0, got {v!r} (tensor)")


def check_number(
    name: str, value: Any, *, low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False
) -> float:
    """Return ``float(value)`` or raise ValueError naming ``name`` when it is not a finite number in range."""
    if isinstance(value, torch.Tensor):
        # reading a CUDA tensor back would be a host sync inside step(); only lr has a sync-free path
        raise TypeError(f"{name} must be a Python number, got a tensor (only lr may be a tensor, as in torch.optim)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (v <= low if low_open else v < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    return v


def check_tensor_list(
    name: str, tensors: Sequence[torch.Tensor], params: List[torch.Tensor], param_names: Callable[[int], str]
) -> List[torch.Tensor]:
    """Check a per-parameter list (controls, corrections) against the parameters; return it as a list."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, one per parameter, got {type(tensors).__name__}")
    if len(tensors) != len(params):
        raise ValueError(f"{name} has {len(tensors)} tensors but the optimizer has {len(params)} parameters")
    for i, (t, p) in enumerate(zip(tensors, params, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} entry for {param_names(i)} is {type(t).__name__}, not a tensor")
        if t.shape != p.shape:
            raise ValueError(f"{name} entry for {param_names(i)} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if t.device != p.device:
            raise ValueError(f"{name} entry for {param_names(i)} is on {t.device}, expected {p.device}")
        if t.is_complex() or t.is_sparse:
            raise TypeError(f"{name} entry for {param_names(i)} must be a dense real tensor")
        _dtensor.check_placed_like(name, t, p, param_names(i))
    return list(tensors)


def extent(p: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """(storage address, first byte, end byte) that ``p`` may touch; None for zero-size tensors."""
    p = _dtensor.local(p)
    if p.numel() == 0:
        return None
    span = sum((s - 1) * abs(st) for s, st in zip(p.shape, p.stride(), strict=True))
    item = p.element_size()
    start = p.storage_offset() * item
    return p.untyped_storage().data_ptr(), int(start), int(start + (span + 1) * item)
