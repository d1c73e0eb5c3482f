"""The reference ``fednar`` op: ``fedopt_kernels.functional.fednar`` over every row group at once
(docs/algorithms.md; FedNAR, Li et al., NeurIPS 2023, Eq. 3-4 and Alg. 2).

hp row: lr (the round's, ``lr * round_decay ** t``: the optimizer's round decay), weight_decay,
max_norm, eps, prox_mu, each row group's own; the global norm spans them all (sharded parameters: every rank's,
through ``between_passes.reducing``).
"""

from __future__ import annotations

from ... import functional
from ..between_passes import current as _sharded
from ..impl_table import register
from ..ops import FEDNAR, OpArgs


@register("fednar", "reference")
def fednar_step(*args, cache=None) -> None:
    a = OpArgs.parse(FEDNAR, args)
    if a.found_inf_now():
        return  # GradScaler found an inf: nothing changes, k included
    t, hp = a.per_tensor()
    functional.fednar(
        t["params"],  # type: ignore[arg-type]  # params and grads have no None entry
        t["grads"],  # type: ignore[arg-type]
        lr=hp["lr"],
        weight_decay=hp["weight_decay"],
        max_norm=hp["max_norm"],
        eps=hp["eps"],
        prox_mu=hp["prox_mu"],
        x0s=t["x0"],
        corrections=t["correction"],
        grad_scale=a.grad_scale,
        reduce=getattr(_sharded, "reduce", None),
    )
    a.k.add_(1)
