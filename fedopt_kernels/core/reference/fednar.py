"""Reference FedNAR step (docs/algorithms.md; "FedNAR: Federated Optimization with Normalized Annealing
Regularization", Li et al., NeurIPS 2023, Eq. 3-4 and Alg. 2).

hp row: step_lr (= lr * round_decay ** t, set by the optimizer), weight_decay, max_norm, eps,
prox_mu. Over all row groups together::

    d    = g + weight_decay * x + correction + prox_mu * (x - x0)
    s    = || all d ||_2                                   # squares summed in float64
    coef = min(1, max_norm / (s + eps))                    # per row group (its own max_norm, eps)
    x   -= (step_lr * coef) * d

NaN/inf in ``s`` propagate (``torch.clamp`` keeps NaN), as ``clip_grad_norm_`` does.
"""

from __future__ import annotations

import torch

from ..impl_table import register
from ..ops import FEDNAR
from ._math import Amp, add_terms, norm_step, up


def fednar_direction(t, i: int, row, amp: Amp) -> torch.Tensor:
    """d of parameter ``i`` of a row group's tensors ``t``, in its compute dtype."""
    _step_lr, wd, _max_norm, _eps, prox_mu = row
    return add_terms(amp.grad(t["grads"][i]), up(t["params"][i]), t, i, wd, prox_mu)


def _clipped_update(xs, ds, row, s: torch.Tensor) -> None:
    step_lr, _wd, max_norm, eps, _mu = row
    coef = torch.clamp(max_norm / (s + eps), max=1.0)
    for x, d in zip(xs, ds, strict=True):
        scale = (step_lr * coef).to(d.dtype)
        x.copy_(up(x) - scale * d)


@register("fednar", "reference")
def fednar_step(*args, cache=None) -> None:
    norm_step(FEDNAR, args, fednar_direction, _clipped_update)
