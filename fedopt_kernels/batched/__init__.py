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

Each algorithm's module defines its client-batched class beside the per-client one and registers
both in its descriptor; this package names them all (``Batched<Optimizer>``).
"""

from __future__ import annotations

from typing import Any, List


def _forms() -> dict:
    from ..fl import algorithm

    return {a.batched.__name__: a.batched for a in algorithm.ALGORITHMS.values()}


def __getattr__(name: str) -> Any:
    forms = _forms()
    if name in forms:
        return forms[name]
    if name == "__all__":
        return sorted(forms)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(list(globals()) + list(_forms()))
