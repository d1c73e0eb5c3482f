"""Reference SGD step shared by FedDecaySGD (SPEC §2) and NeuronLRSGD (SPEC §3).

For each parameter ``x`` with gradient ``g`` (``hp``: lr, momentum, dampening, nesterov,
weight_decay, maximize, prox_mu)::

    lr_k = lr * s(k // decay_every)                          # FedDecay, seed 000 Eq. 4
    d    = (-g if maximize else g) + weight_decay * x + correction + prox_mu * (x - x0)
    buf  = momentum * buf + (1 - dampening) * d              # torch.optim.SGD semantics
    d    = d + momentum * buf  if nesterov  else  buf        # (when momentum != 0)
    x   -= (lr_k * r[m]) * d[m, ...]                         # FedNLR, seed 001 Eq. 18 (r = 1 without scales)

A fresh momentum buffer arrives zero-filled with ``dampening = 0``, which makes ``buf = d`` on
the first step exactly as torch does.
"""
from __future__ import annotations

import torch

from .._batch import Group, StepContext
from .._registry import register
from ._math import up


def row_view(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-output-unit scale ``r`` [M] shaped to broadcast over ``x`` [M, ...]."""
    return r.view(-1, *([1] * (x.dim() - 1)))


@register("sgd", "reference")
def sgd_step(groups: list[Group], ctx: StepContext) -> None:
    factor = ctx.lr_factor()
    for grp in groups:
        hp = grp.hp
        lr_k = hp["lr"] * factor
        momentum, dampening, wd = hp["momentum"], hp["dampening"], hp["weight_decay"]
        for i, (x, g) in enumerate(zip(grp.params, grp.grads)):
            xf = up(x)
            d = up(g)
            if hp["maximize"]:
                d = -d
            if wd != 0:
                d = d + wd * xf
            if "correction" in grp.tensors:
                d = d + up(grp.tensors["correction"][i])
            if "x0" in grp.tensors:
                d = d + hp["prox_mu"] * (xf - up(grp.tensors["x0"][i]))
            if momentum != 0:
                buf = grp.tensors["momentum_buffer"][i]
                bf = up(buf) * momentum + (1 - dampening) * d
                buf.copy_(bf)
                d = d + momentum * bf if hp["nesterov"] else bf
            if "neuron_scale" in grp.tensors:
                r = up(grp.tensors["neuron_scale"][i])
                x.copy_(xf - row_view(lr_k * r, x) * d)
            else:
                x.copy_(xf - lr_k * d)
