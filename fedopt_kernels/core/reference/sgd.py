"""The reference ``sgd`` op: ``fedopt_kernels.functional.sgd`` on each row group (docs/algorithms.md).

FedDecaySGD, NeuronLRSGD, FedDyn and FedSAM's descent run this op. hp row: lr, momentum, dampening,
weight_decay, prox_mu, nesterov, maximize. The step's learning rate is ``lr * s(j)`` with
``j = min(k // decay_every, len(table) - 1)`` (FedDecay's within-round decay, ``k`` read on the
host); a fresh momentum buffer arrives zero-filled with ``dampening = 0``, which makes ``buf = d`` on
the first step exactly as torch does.
"""

from __future__ import annotations

from ... import functional
from ..impl_table import register
from ..ops import SGD, OpArgs


@register("sgd", "reference")
def sgd_step(*args, cache=None) -> None:
    a = OpArgs.parse(SGD, args)
    if a.found_inf_now():
        return  # GradScaler found an inf: nothing changes, k included
    j = min(int(a.k.reshape(-1)[0]) // a.decay_every, a.table.numel() - 1)
    s = float(a.table[j])
    for group in a.row_groups():
        lr, momentum, dampening, wd, prox_mu, nesterov, maximize = a.hp[group.row].tolist()
        t = group.tensors
        functional.sgd(
            t["params"],
            t["grads"],
            t.get("momentum_buffer"),  # type: ignore[arg-type]  # a list of buffers, none of them None
            lr=lr * s,
            momentum=momentum,
            dampening=dampening,
            weight_decay=wd,
            nesterov=bool(nesterov),
            maximize=bool(maximize),
            prox_mu=prox_mu,
            x0s=t.get("x0"),
            corrections=t.get("correction"),
            neuron_scales=t.get("neuron_scale"),
            grad_scale=a.grad_scale,
        )
    a.k.add_(1)
