"""Reference PAdaMFed client step (docs/algorithms.md; "Problem-Parameter-Free Federated Learning",
Alg. 1, Thm. 1-2).

hp row: lr (eta), beta, eps. Per-tensor inputs: ``D`` (= beta*(c - c_i) + (1-beta)*m, fixed for
the round), ``acc`` (running sum of raw gradients) and, for the VR variant, ``anchor_grad`` (H).
Over all row groups together::

    v    = beta * G + D                       (VR: v = G + D - (1 - beta) * H)
    acc += G
    n    = max(|| all v ||_2, eps)            # squares summed in float64; eps of each row group
    x   -= v * (eta / n)                      # every step moves x by exactly eta
"""

from __future__ import annotations

import torch

from ..impl_table import register
from ..ops import PADAMFED
from ._math import Amp, norm_step, up


def padamfed_direction(t, i: int, beta: float, G: torch.Tensor) -> torch.Tensor:
    """v of parameter ``i`` of a row group's tensors ``t`` given its unscaled gradient ``G``."""
    D = up(t["D"][i])
    if "anchor_grad" in t:
        return G + D - (1 - beta) * up(t["anchor_grad"][i])
    return beta * G + D


def _direction_and_sum(t, i: int, row, amp: Amp) -> torch.Tensor:
    """v of parameter ``i``; adds its unscaled gradient to ``acc`` (pass 1)."""
    G = amp.grad(t["grads"][i])
    v = padamfed_direction(t, i, row[1], G)
    t["acc"][i].add_(G)
    return v


def _normalized_update(xs, vs, row, norm: torch.Tensor) -> None:
    lr, _beta, eps = row
    scale_all = lr / torch.clamp(norm, min=eps)
    for x, v in zip(xs, vs, strict=True):
        x.copy_(up(x) - v * scale_all.to(v.dtype))


@register("padamfed", "reference")
def padamfed_step(*args, cache=None) -> None:
    norm_step(PADAMFED, args, _direction_and_sum, _normalized_update)
