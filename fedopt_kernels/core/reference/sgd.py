"""Reference SGD step shared by FedDecaySGD (docs/algorithms.md) and NeuronLRSGD (docs/algorithms.md).

For each parameter ``x`` with gradient ``g`` (hp row: lr, momentum, dampening, weight_decay,
prox_mu, nesterov, maximize)::

    lr_k = lr * s(k // decay_every)                          # FedDecay, within-round decay
    d    = (-g if maximize else g) + weight_decay * x + correction + prox_mu * (x - x0)
    buf  = momentum * buf + (1 - dampening) * d              # torch.optim.SGD semantics
    d    = d + momentum * buf  if nesterov  else  buf        # (when momentum != 0)
    x   -= (lr_k * r[m]) * d[m, ...]                         # FedNLR (r = 1 without scales)

A fresh momentum buffer arrives zero-filled with ``dampening = 0``, which makes ``buf = d`` on
the first step exactly as torch does.
"""

from __future__ import annotations

import torch

from ..args import OpArgs
from ..impl_table import register
from ..ops import SGD
from ._math import Amp, add_terms, advance, up


def row_view(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-output-unit scale ``r`` [M] shaped to broadcast over ``x`` [M, ...]."""
    return r.view(-1, *([1] * (x.dim() - 1)))


def lr_factor(a: OpArgs) -> float:
    """s(min(k // decay_every, len(table) - 1)), read on the host."""
    j = min(int(a.k.reshape(-1)[0]) // a.decay_every, a.table.numel() - 1)
    return float(a.table[j])


@register("sgd", "reference")
def sgd_step(*args, cache=None) -> None:
    a = OpArgs.parse(SGD, args)
    amp = Amp(a)
    if not amp.skip:
        factor = lr_factor(a)
        for group in a.row_groups():
            lr, momentum, dampening, wd, prox_mu, nesterov, maximize = a.hp[group.row].tolist()
            lr_k = lr * factor
            t = group.tensors
            for i, (x, g) in enumerate(zip(t["params"], t["grads"], strict=True)):
                xf = up(x)
                d = amp.grad(g)
                if maximize:
                    d = -d
                d = add_terms(d, xf, t, i, wd, prox_mu)
                if "momentum_buffer" in t:
                    buf = t["momentum_buffer"][i]
                    bf = up(buf) * momentum + (1 - dampening) * d
                    buf.copy_(bf)
                    d = d + momentum * bf if nesterov else bf
                if "neuron_scale" in t:
                    r = up(t["neuron_scale"][i])
                    x.copy_(xf - row_view(lr_k * r, x) * d)
                else:
                    x.copy_(xf - lr_k * d)
    advance(a, amp)
