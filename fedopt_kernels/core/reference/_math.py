"""Small helpers shared by the reference ops: compute dtypes, the global norm, AMP and the counter."""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import torch

from ..args import OpArgs
from ..between_passes import current as _SHARDED
from ..ops import OpSpec


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for float64 tensors, float32 otherwise (docs/backends.md: math in float32)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def up(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its compute dtype (a copy only when the dtype changes)."""
    return t.to(compute_dtype(t))


def norm_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype the norm's *result* is used in: float64 when any tensor is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def global_norm(tensors: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm over all ``tensors`` as a float64 0-dim tensor; with sharded parameters
    (``between_passes.reducing``) ``sqrt(reduce(float64 sum of squares per tensor))``.

    Squares are summed in float64 (a float32 sum of squares overflows for elements near 1e20
    and underflows near 1e-23), so the norm is right to ~1e-15 for every finite input in
    [1e-30, 1e30]; callers round it to ``norm_dtype`` before using it, as the kernels do.
    """
    reduce = getattr(_SHARDED, "reduce", None)
    if reduce is not None:
        sums = [torch.sum(t.to(torch.float64) * t.to(torch.float64)) for t in tensors]
        per_tensor = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
        return reduce(per_tensor).reshape(()).sqrt()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        t64 = t.to(torch.float64)
        total = total + torch.sum(t64 * t64)
    return total.sqrt()


class Amp:
    """GradScaler's inputs as the reference applies them: skip the step when ``found_inf`` is set,
    else divide every gradient by ``grad_scale`` (as a multiplication by its float32 reciprocal,
    which is what ``GradScaler.unscale_`` does)."""

    def __init__(self, a: OpArgs):
        self.skip = a.found_inf is not None and float(a.found_inf.reshape(-1)[0]) != 0.0
        self.inv = None
        if a.grad_scale is not None:
            self.inv = a.grad_scale.reshape(-1)[0].double().reciprocal().float()

    def grad(self, g: torch.Tensor) -> torch.Tensor:
        """The unscaled gradient in its compute dtype."""
        gf = up(g)
        return gf if self.inv is None else gf * self.inv.to(gf.dtype)


def add_terms(d: torch.Tensor, xf: torch.Tensor, t, i: int, weight_decay: float, prox_mu: float) -> torch.Tensor:
    """d + weight_decay * x + correction + prox_mu * (x - x0), each term only when present (the
    order every fused kernel follows); ``t``: a row group's tensors, ``i``: the parameter's index."""
    if weight_decay != 0:
        d = d + weight_decay * xf
    if "correction" in t:
        d = d + up(t["correction"][i])
    if "x0" in t:
        d = d + prox_mu * (xf - up(t["x0"][i]))
    return d


def advance(a: OpArgs, amp: Optional[Amp]) -> None:
    """k += 1, unless GradScaler found an inf (then the step did not happen)."""
    if amp is None or not amp.skip:
        a.k.add_(1)


Direction = Callable[[dict, int, List[float], Amp], torch.Tensor]
Update = Callable[[List[torch.Tensor], List[torch.Tensor], List[float], torch.Tensor], None]


def norm_step(spec: OpSpec, args: tuple, direction: Direction, update: Update) -> None:
    """A norm op's step: ``direction(row group tensors, i, hp row, amp)`` of every parameter, row group
    by row group (pass 1), their global norm rounded as the kernels round it, then ``update(params,
    directions, hp row, norm)`` per row group (pass 2); a step skipped by GradScaler changes nothing."""
    a = OpArgs.parse(spec, args)
    amp = Amp(a)
    if not amp.skip and a.lists["params"]:
        groups = a.row_groups()
        rows = {b.row: a.hp[b.row].tolist() for b in groups}
        ds = [[direction(b.tensors, i, rows[b.row], amp) for i in range(len(b.tensors["params"]))] for b in groups]
        norm = global_norm([d for per in ds for d in per], a.device).to(norm_dtype(a.lists["params"]))
        for b, per in zip(groups, ds, strict=True):
            update(b.tensors["params"], per, rows[b.row], norm)
    advance(a, amp)
