"""Parameters and param groups, checked where they are given (docs/algorithms.md, "Bad input").

A param group is normalised as torch.optim does (a tensor, a list, ``(name, tensor)`` pairs) and
refused, naming the parameter, when a fused step could not update it as the reference does:
complex or integer tensors, the same tensor twice, views that overlap, a backend named explicitly
that cannot run on the parameters' device. ``FedOptimizer.add_param_group`` runs these before it
changes anything, so a rejected group adds nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import torch

from . import registry as _registry
from .checks import extent
from .plan_inputs import param_name

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# how errors name flat parameter ``i`` of a parameter list: the optimizer's ``_name_of(i, params)``
NameOf = Callable[[int, List[torch.Tensor]], str]


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
