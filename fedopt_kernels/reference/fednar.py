"""Reference FedNAR step (SPEC §4; seed 003, Eq. 3-4 and Alg. 2).

``hp``: step_lr (= lr * round_decay ** t, set by the optimizer), weight_decay, max_norm, eps,
prox_mu. Over all groups together::

    d    = g + weight_decay * x + correction + prox_mu * (x - x0)
    s    = || all d ||_2                                   # clip_grad_norm_ semantics
    coef = min(1, max_norm / (s + eps))                    # per group (its own max_norm, eps)
    x   -= (step_lr * coef) * d

NaN/inf in ``s`` propagate (``torch.clamp`` keeps NaN), as ``clip_grad_norm_`` does.
"""
from __future__ import annotations

import torch

from .._batch import Group, StepContext
from .._registry import register
from ._math import global_norm, norm_dtype, up


def fednar_direction(grp: Group, i: int) -> torch.Tensor:
    """d of parameter ``i`` of ``grp``, in its compute dtype."""
    hp, x = grp.hp, grp.params[i]
    xf = up(x)
    d = up(grp.grads[i])
    if hp["weight_decay"] != 0:
        d = d + hp["weight_decay"] * xf
    if "correction" in grp.tensors:
        d = d + up(grp.tensors["correction"][i])
    if "x0" in grp.tensors:
        d = d + hp["prox_mu"] * (xf - up(grp.tensors["x0"][i]))
    return d


@register("fednar", "reference")
def fednar_step(groups: list[Group], ctx: StepContext) -> None:
    ds = [[fednar_direction(grp, i) for i in range(len(grp.params))] for grp in groups]
    flat = [d for per_group in ds for d in per_group]
    all_params = [x for grp in groups for x in grp.params]
    s = global_norm(flat, norm_dtype(all_params), all_params[0].device)
    for grp, per_group in zip(groups, ds):
        hp = grp.hp
        coef = torch.clamp(hp["max_norm"] / (s + hp["eps"]), max=1.0)
        for x, d in zip(grp.params, per_group):
            scale = (hp["step_lr"] * coef).to(d.dtype)
            x.copy_(up(x) - scale * d)
