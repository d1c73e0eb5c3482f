"""The reference ``fedexp`` op: ``fedopt_kernels.functional.fedexp`` over every row group at once
(docs/algorithms.md; "FedExP", Jhunjhunwala, Wang, Joshi, ICLR 2023).

hp row: lr, eps, mean_sq_norm (the round's weighted mean of the clients' squared update norms, which
the optimizer writes into the column before each step); the global norm spans every row group
(sharded parameters: every rank's, through ``between_passes.reducing``).
"""

from __future__ import annotations

from ... import functional
from ..between_passes import current as _sharded
from ..impl_table import register
from ..ops import FEDEXP, OpArgs


@register("fedexp", "reference")
def fedexp_step(*args, cache=None) -> None:
    a = OpArgs.parse(FEDEXP, args)
    if a.found_inf_now():
        return  # GradScaler found an inf: nothing changes, k included
    t, hp = a.per_tensor()
    functional.fedexp(
        t["params"],  # type: ignore[arg-type]  # params and grads have no None entry
        t["grads"],  # type: ignore[arg-type]
        mean_sq_norm=hp["mean_sq_norm"],
        eps=hp["eps"],
        lr=hp["lr"],
        grad_scale=a.grad_scale,
        reduce=getattr(_sharded, "reduce", None),
    )
    a.k.add_(1)
