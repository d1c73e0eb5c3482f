"""The reference ``sam_ascent`` op: ``fedopt_kernels.functional.sam_ascent`` over every row group at
once (docs/algorithms.md; FedSAM, Caldarola et al., ECCV 2022; SAM: Foret et al., ICLR 2021; ASAM:
Kwon et al., ICML 2021). The descent that follows is the ``sgd`` op.

hp row: rho, eta, eps, adaptive (1.0 or 0.0), each row group's own; the global norm spans them all.
The ``saved_x`` role (the optimizer always gives it; a bare op call may not) receives ``x`` first.
"""

from __future__ import annotations

from ... import functional
from ..between_passes import current as _sharded
from ..impl_table import register
from ..ops import SAM_ASCENT, OpArgs


@register("sam_ascent", "reference")
def sam_ascent_step(*args, cache=None) -> None:
    a = OpArgs.parse(SAM_ASCENT, args)
    if a.found_inf_now():
        return  # GradScaler found an inf: nothing changes, k included
    t, hp = a.per_tensor()
    functional.sam_ascent(
        t["params"],  # type: ignore[arg-type]  # params and grads have no None entry
        t["grads"],  # type: ignore[arg-type]
        t["saved_x"],
        rho=hp["rho"],
        eta=hp["eta"],
        eps=hp["eps"],
        adaptive=[v != 0.0 for v in hp["adaptive"]],
        grad_scale=a.grad_scale,
        reduce=getattr(_sharded, "reduce", None),
    )
    a.k.add_(1)
