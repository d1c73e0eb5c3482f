"""Reference FedNAR step (docs/algorithms.md; "FedNAR: Federated Optimization with Normalized Annealing
Regularization", Li et al., NeurIPS 2023, Eq. 3-4 and Alg. 2).

hp row: step_lr (= lr * round_decay ** t, set by the optimizer), weight_decay, max_norm, eps,
prox_mu. Over all batches together::

    d    = g + weight_decay * x + correction + prox_mu * (x - x0)
    s    = || all d ||_2                                   # squares summed in float64
    coef = min(1, max_norm / (s + eps))                    # per batch (its own max_norm, eps)
    x   -= (step_lr * coef) * d

NaN/inf in ``s`` propagate (``torch.clamp`` keeps NaN), as ``clip_grad_norm_`` does.
"""
from __future__ import annotations

import torch

from .._args import OpArgs
from .._ops import FEDNAR
from .._registry import register
from ._math import Amp, add_terms, advance, global_norm, norm_dtype, up


def fednar_direction(t, i: int, row, amp: Amp) -> torch.Tensor:
    """d of parameter ``i`` of a batch's tensors ``t``, in its compute dtype."""
    _step_lr, wd, _max_norm, _eps, prox_mu = row
    return add_terms(amp.grad(t["grads"][i]), up(t["params"][i]), t, i, wd, prox_mu)


@register("fednar", "reference")
def fednar_step(*args, cache=None) -> None:
    a = OpArgs.parse(FEDNAR, args)
    amp = Amp(a)
    if not amp.skip and a.lists["params"]:
        batches = a.batches()
        rows = {b.index: a.hp[b.index].tolist() for b in batches}
        ds = [[fednar_direction(b.tensors, i, rows[b.index], amp) for i in range(len(b.tensors["params"]))]
              for b in batches]
        s = global_norm([d for per in ds for d in per], a.device).to(norm_dtype(a.lists["params"]))
        for b, per in zip(batches, ds):
            step_lr, _wd, max_norm, eps, _mu = rows[b.index]
            coef = torch.clamp(max_norm / (s + eps), max=1.0)
            for x, d in zip(b.tensors["params"], per):
                scale = (step_lr * coef).to(d.dtype)
                x.copy_(up(x) - scale * d)
    advance(a, amp)
