"""Reference PAdaMFed client step (SPEC §5; seed 004, Alg. 1).

``hp``: lr (eta), beta, eps, variance_reduction. Per-tensor inputs: ``D`` (= beta*(c - c_i) +
(1-beta)*m, fixed for the round), ``acc`` (running sum of raw gradients) and, for the VR variant,
``anchor_grad`` (H). Over all groups together::

    v    = beta * G + D                       (VR: v = G + D - (1 - beta) * H)
    acc += G
    n    = max(|| all v ||_2, eps)            # eps of each group
    x   -= v * (eta / n)                      # every step moves x by exactly eta
"""
from __future__ import annotations

import torch

from .._batch import Group, StepContext
from .._registry import register
from ._math import global_norm, norm_dtype, up


def padamfed_direction(grp: Group, i: int) -> torch.Tensor:
    """v of parameter ``i`` of ``grp``, in its compute dtype."""
    hp = grp.hp
    G = up(grp.grads[i])
    D = up(grp.tensors["D"][i])
    if hp["variance_reduction"]:
        return G + D - (1 - hp["beta"]) * up(grp.tensors["anchor_grad"][i])
    return hp["beta"] * G + D


@register("padamfed", "reference")
def padamfed_step(groups: list[Group], ctx: StepContext) -> None:
    vs = [[padamfed_direction(grp, i) for i in range(len(grp.params))] for grp in groups]
    for grp in groups:
        for g, acc in zip(grp.grads, grp.tensors["acc"]):
            acc.add_(up(g))
    flat = [v for per_group in vs for v in per_group]
    all_params = [x for grp in groups for x in grp.params]
    norm = global_norm(flat, norm_dtype(all_params), all_params[0].device)
    for grp, per_group in zip(groups, vs):
        n = torch.clamp(norm, min=grp.hp["eps"])
        scale_all = grp.hp["lr"] / n
        for x, v in zip(grp.params, per_group):
            x.copy_(up(x) - v * scale_all.to(v.dtype))
