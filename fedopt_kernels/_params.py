"""How errors name a parameter, and what its gradient must be: shared by the optimizer and its step plan."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch


def param_name(gi: int, pi: int, p: torch.Tensor, name: Optional[str] = None) -> str:
    named = f" ({name!r})" if name is not None else ""
    return f"parameter {pi}{named} of param group {gi} (shape {tuple(p.shape)})"


def name_of(groups: Sequence[Dict[str, Any]], idx: int, params: List[torch.Tensor]) -> str:
    """How errors name flat parameter ``idx`` of ``groups`` (built only when raising)."""
    base = 0
    for gi, group in enumerate(groups):
        n = len(group["params"])
        if idx < base + n:
            names = group.get("param_names")
            return param_name(gi, idx - base, params[idx], names[idx - base] if names else None)
        base += n
    return param_name(len(groups), idx - base, params[idx])


def check_grad(p: torch.Tensor, g: torch.Tensor, idx: int, groups: Sequence[Dict[str, Any]],
               params: List[torch.Tensor], owner: str) -> None:
    """Refuse a gradient the kernels cannot take, naming flat parameter ``idx``; ``owner``: the optimizer class."""
    if g.is_sparse:
        raise RuntimeError(f"{name_of(groups, idx, params)} has a sparse gradient; {owner} does not support sparse "
                           f"gradients")
    if g.is_complex() or p.is_complex():
        raise TypeError(f"{name_of(groups, idx, params)} is complex; {owner} supports real parameters only")
    if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
        raise RuntimeError(f"{name_of(groups, idx, params)}: gradient of shape {tuple(g.shape)}, {g.dtype}, {g.device} "
                           f"does not match the parameter ({tuple(p.shape)}, {p.dtype}, {p.device})")
