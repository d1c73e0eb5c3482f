"""Reference PAdaMFed client step (docs/algorithms.md; "Problem-Parameter-Free Federated Learning",
Alg. 1, Thm. 1-2).

hp row: lr (eta), beta, eps. Per-tensor inputs: ``D`` (= beta*(c - c_i) + (1-beta)*m, fixed for
the round), ``acc`` (running sum of raw gradients) and, for the VR variant, ``anchor_grad`` (H).
Over all batches together::

    v    = beta * G + D                       (VR: v = G + D - (1 - beta) * H)
    acc += G
    n    = max(|| all v ||_2, eps)            # squares summed in float64; eps of each batch
    x   -= v * (eta / n)                      # every step moves x by exactly eta
"""
from __future__ import annotations

import torch

from .._args import OpArgs
from .._ops import PADAMFED
from .._registry import register
from ._math import Amp, advance, global_norm, norm_dtype, up


def padamfed_direction(t, i: int, beta: float, G: torch.Tensor) -> torch.Tensor:
    """v of parameter ``i`` of a batch's tensors ``t`` given its unscaled gradient ``G``."""
    D = up(t["D"][i])
    if "anchor_grad" in t:
        return G + D - (1 - beta) * up(t["anchor_grad"][i])
    return beta * G + D


@register("padamfed", "reference")
def padamfed_step(*args, cache=None) -> None:
    a = OpArgs.parse(PADAMFED, args)
    amp = Amp(a)
    if not amp.skip and a.lists["params"]:
        batches = a.batches()
        rows = {b.index: a.hp[b.index].tolist() for b in batches}
        vs = []
        for b in batches:
            t, beta = b.tensors, rows[b.index][1]
            per = []
            for i in range(len(t["params"])):
                G = amp.grad(t["grads"][i])
                per.append(padamfed_direction(t, i, beta, G))
                t["acc"][i].add_(G)
            vs.append(per)
        norm = global_norm([v for per in vs for v in per], a.device).to(norm_dtype(a.lists["params"]))
        for b, per in zip(batches, vs):
            lr, _beta, eps = rows[b.index]
            n = torch.clamp(norm, min=eps)
            scale_all = lr / n
            for x, v in zip(b.tensors["params"], per):
                x.copy_(up(x) - v * scale_all.to(v.dtype))
    advance(a, amp)
