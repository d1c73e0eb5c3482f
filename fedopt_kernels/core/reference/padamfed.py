"""The reference ``padamfed`` op: ``fedopt_kernels.functional.padamfed`` over every row group at once
(docs/algorithms.md; "Problem-Parameter-Free Federated Learning", Alg. 1, Thm. 1-2).

hp row: lr (eta), beta, eps, each row group's own; the global norm spans them all (sharded
parameters: every rank's, through ``between_passes.reducing``).
"""

from __future__ import annotations

from ... import functional
from ..between_passes import current as _sharded
from ..impl_table import register
from ..ops import PADAMFED, OpArgs


@register("padamfed", "reference")
def padamfed_step(*args, cache=None) -> None:
    a = OpArgs.parse(PADAMFED, args)
    if a.found_inf_now():
        return  # GradScaler found an inf: nothing changes, k included
    t, hp = a.per_tensor()
    functional.padamfed(
        t["params"],  # type: ignore[arg-type]  # every tensor has these roles
        t["grads"],  # type: ignore[arg-type]
        t["D"],  # type: ignore[arg-type]
        t["acc"],  # type: ignore[arg-type]
        lr=hp["lr"],
        beta=hp["beta"],
        eps=hp["eps"],
        anchor_grads=t["anchor_grad"],
        grad_scale=a.grad_scale,
        reduce=getattr(_sharded, "reduce", None),
    )
    a.k.add_(1)
