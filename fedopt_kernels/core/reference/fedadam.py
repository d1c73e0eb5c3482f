"""The reference ``fedadam`` op: ``fedopt_kernels.functional.fedadam`` on each row group
(docs/algorithms.md; "Adaptive Federated Optimization", Reddi et al., ICLR 2021, Algorithm 2).

FedAdam, FedYogi and FedAdagrad run this op. hp row: lr, beta1, beta2, tau, rule (0 Adam, 1 Yogi,
2 Adagrad), bias_correction (0 or 1). The bias correction's step ``t`` is ``k + 1`` (``k`` read on
the host).
"""

from __future__ import annotations

from ... import functional
from ..impl_table import register
from ..ops import FEDADAM, OpArgs


@register("fedadam", "reference")
def fedadam_step(*args, cache=None) -> None:
    a = OpArgs.parse(FEDADAM, args)
    if a.found_inf_now():
        return  # GradScaler found an inf: nothing changes, k included
    step = int(a.k.reshape(-1)[0]) + 1
    for group in a.row_groups():
        lr, beta1, beta2, tau, rule, bias_correction = a.hp[group.row].tolist()
        t = group.tensors
        functional.fedadam(
            t["params"],
            t["grads"],
            t["exp_avg"],
            t["exp_avg_sq"],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            tau=tau,
            rule=functional.ADAPTIVE_RULES[int(rule)],
            step=step,
            bias_correction=bool(bias_correction),
            grad_scale=a.grad_scale,
        )
    a.k.add_(1)
