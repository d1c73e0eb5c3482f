"""Reference FedSAM ascent (docs/algorithms.md; "Improving Generalization in Federated Learning by
Seeking Flat Minima", Caldarola et al., ECCV 2022; SAM: Foret et al., ICLR 2021; ASAM: Kwon et al.,
ICML 2021). The descent that follows is the ``sgd`` op.

hp row: rho, eta, eps, adaptive (1.0 or 0.0). Over all row groups together::

    w     = |x| + eta   (adaptive)   or 1                 # elementwise, per row group
    d     = w * g                                          # g itself when not adaptive
    s     = || all d ||_2                                  # squares summed in float64
    scale = rho / (s + eps)                                # per row group (its own rho, eps)
    saved = x ;  x += scale * (w * d)                      # = rho * w^2 * g / (s + eps)

(``saved`` where the row group has the ``saved_x`` role, as the optimizer always gives it).

so ``||x_after - x_before|| = rho * s / (s + eps)`` without ``adaptive``: ``rho`` up to ``eps``.
"""

from __future__ import annotations

import torch

from ..args import OpArgs
from ..impl_table import register
from ..ops import SAM_ASCENT
from ._math import Amp, advance, global_norm, norm_dtype, up


def _weight(x: torch.Tensor, row) -> torch.Tensor:
    """ASAM's w = |x| + eta in the compute dtype."""
    return up(x).abs() + row[1]


def sam_direction(t, i: int, row, amp: Amp) -> torch.Tensor:
    """d = w * g of parameter ``i`` of a row group's tensors ``t`` (g when not adaptive), in its compute dtype."""
    g = amp.grad(t["grads"][i])
    return _weight(t["params"][i], row) * g if row[3] else g


@register("sam_ascent", "reference")
def sam_ascent_step(*args, cache=None) -> None:
    a = OpArgs.parse(SAM_ASCENT, args)
    amp = Amp(a)
    if not amp.skip and a.lists["params"]:
        groups = a.row_groups()
        rows = {b.row: a.hp[b.row].tolist() for b in groups}
        ds = [[sam_direction(b.tensors, i, rows[b.row], amp) for i in range(len(b.tensors["params"]))] for b in groups]
        norm = global_norm([d for per in ds for d in per], a.device).to(norm_dtype(a.lists["params"]))
        for b, per in zip(groups, ds, strict=True):
            row = rows[b.row]
            rho, _eta, eps, adaptive = row
            scale = rho / (norm + eps)
            t = b.tensors
            for i, (x, d) in enumerate(zip(t["params"], per, strict=True)):
                if "saved_x" in t:  # the optimizer always gives it; a bare op call may not
                    t["saved_x"][i].copy_(x)
                w_d = _weight(x, row) * d if adaptive else d
                x.copy_(up(x) + scale.to(d.dtype) * w_d)
    advance(a, amp)
