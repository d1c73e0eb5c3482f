"""Validators the optimizers share (docs/algorithms.md, "Bad input": an error names the parameter or
hyperparameter, and a rejected call changes nothing): numbers, tensor learning rates, per-parameter
tensor lists, and the parameters and param groups where they are given.

A param group is normalised as torch.optim does (a tensor, a list, ``(name, tensor)`` pairs) and
refused, naming the parameter, when a fused step could not update it as the reference does:
complex or integer tensors, the same tensor twice, views that overlap, a backend named explicitly
that cannot run on the parameters' device. ``FedOptimizer.add_param_group`` runs these before it
changes anything, so a rejected group adds nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import dtensor as _dtensor
from . import registry as _registry
from .plan_inputs import param_name

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# how errors name flat parameter ``i`` of a parameter list: the optimizer's ``_name_of(i, params)``
NameOf = Callable[[int, List[torch.Tensor]], str]


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
    if type(p) not in _PLAIN:  # a DTensor: its local shard (a plain tensor is no DTensor)
        p = _dtensor.local(p)
    if p.numel() == 0:
        return None
    span = sum((s - 1) * abs(st) for s, st in zip(p.shape, p.stride(), strict=True))
    item = p.element_size()
    start = p.storage_offset() * item
    return p.untyped_storage().data_ptr(), int(start), int(start + (span + 1) * item)


# ------------------------------------------------------------------------------- parameters and param groups
def normalized_group(param_group: Dict[str, Any], defaults: Mapping[str, Any], gi: int) -> Dict[str, Any]:
    """Param group ``gi`` as torch.optim keeps it: ``params`` a list (names apart), defaults filled in."""
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    if "params" not in param_group:
        raise ValueError("param_group has no 'params'")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the "
            "ordering of tensors in sets will change between runs. Please use a list instead."
        )
    else:
        params = list(params)
    group = dict(param_group)
    named = [isinstance(p, tuple) for p in params]
    if any(named):  # (name, tensor) pairs, e.g. model.named_parameters(): torch.optim keeps the names
        if not all(named):
            raise ValueError("all optimizer params should be with/without names. Some param names are missing")
        for pi, item in enumerate(params):
            if len(item) != 2 or not isinstance(item[0], str):
                raise TypeError(
                    f"named parameter {pi} of param group {gi} must be a (name, tensor) pair with "
                    f"a str name, got {item!r:.80}"
                )
        group["param_names"] = [name for name, _ in params]
        params = [p for _, p in params]
    group["params"] = params
    for name, default in defaults.items():
        group.setdefault(name, default)
    return group


def check_new_params(params: Sequence[Any], known: Sequence[torch.Tensor], owner: str, gi: int) -> None:
    """Each of param group ``gi``'s ``params`` a real floating tensor, none given twice (``known``: the
    optimizer's parameters so far); ``owner``: the optimizer class, for the messages."""
    seen = {id(p) for p in known}
    for pi, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"{owner} can only optimize Tensors, but parameter {pi} of param group {gi} is a {type(p).__name__}"
            )
        if p.is_complex():
            raise TypeError(f"{param_name(gi, pi, p)} is complex; {owner} supports real parameters only")
        if p.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{param_name(gi, pi, p)} has dtype {p.dtype}; supported: {_FLOAT_DTYPES}")
        if id(p) in seen:
            raise ValueError(
                f"{param_name(gi, pi, p)} is given twice (the same tensor in one or two param "
                f"groups); a fused step would update it once where the reference updates it twice"
            )
        seen.add(id(p))


def check_backend_runs(backend: str, op: str, params: Sequence[torch.Tensor], gi: int) -> None:
    """A backend named explicitly must run these parameters: refused here, where it is named,
    not at the first ``step()`` (``auto`` picks one that runs)."""
    if backend == "auto":
        return
    checked = set()
    for pi, p in enumerate(params):
        if p.device in checked:
            continue
        checked.add(p.device)
        why = _registry.unavailable_reason(backend, p.device, op)
        if why is not None:
            # a backend that runs elsewhere: the parameters' device is what to change
            hint = (
                " (move the model before building the optimizer)"
                if _registry.unavailable_reason(backend, None, op) is None
                else ""
            )
            raise ValueError(
                f"backend={backend!r} cannot run {param_name(gi, pi, p)}, on {p.device}: "
                f"{why}; use backend='auto' or a backend that runs there{hint}"
            )


def check_no_overlap(params: List[torch.Tensor], name_of: NameOf) -> None:
    """Refuse parameters that share memory (overlapping views of one storage)."""
    by_storage: Dict[int, List[Tuple[int, int, int]]] = {}
    for i, p in enumerate(params):
        ext = extent(p)
        if ext is None:
            continue
        spans = by_storage.setdefault(ext[0], [])
        for lo, hi, j in spans:
            if ext[1] < hi and lo < ext[2]:
                raise ValueError(
                    f"{name_of(j, params)} and {name_of(i, params)} share memory "
                    f"(overlapping views of one storage); each parameter must own its memory"
                )
        spans.append((ext[1], ext[2], i))
