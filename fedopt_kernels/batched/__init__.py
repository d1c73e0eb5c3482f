"""Client-batched optimizers (docs/client_batched.md): many clients' local steps as one computation.

Every parameter is a stack of client copies ``[C, *shape]`` (``torch.func.stack_module_state``
makes them from C models); so are momentum buffers, corrections, controls and anchors, FedNLR
scales are ``[C, M]``, and the round index, a learning-rate scale and an active mask are per
client. FedNAR's co-norm and PAdaMFed's normalisation are per client. Client ``c``'s result is
what the package's per-client optimizer computes for client ``c`` alone::

    params = [torch.nn.Parameter(w) for w in stacked.values()]       # each [C, *shape]
    opt = BatchedFedNAR(params, lr=0.1, weight_decay=1e-3)
    opt.start_round(round_index=t, correction=[c - ci for c, ci in ...])   # [C, *shape] each
    for step in range(K):
        ... p.grad = per-client gradients [C, *shape] (e.g. torch.func.vmap(torch.func.grad(loss)))
        opt.step(active=steps_left > step)                              # clients with fewer steps sit out

Each optimizer's module defines its client-batched class beside the per-client one; this package
names every class made with the mixin (``Batched<Optimizer>``), an algorithm's added later too.
"""

from __future__ import annotations

from typing import Any, List

from .mixin import ClientBatched


def _forms() -> dict:
    """Every class made with the mixin by its name (the first made where two share one)."""
    out: dict = {}
    todo = [ClientBatched]
    while todo:
        for sub in todo.pop(0).__subclasses__():
            out.setdefault(sub.__name__, sub)
            todo.append(sub)
    return out


def __getattr__(name: str) -> Any:
    forms = _forms()
    if name in forms:
        return forms[name]
    if name == "__all__":
        return sorted(forms)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(list(globals()) + list(_forms()))
