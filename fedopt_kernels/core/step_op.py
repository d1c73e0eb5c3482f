"""``fedopt::optimizer_step``: a whole ``step()`` as one opaque op, which is what torch.compile sees.

Under ``torch.compile`` an optimizer's ``step()`` reduces to this op over its parameters and their
gradients (plus per-step inputs and GradScaler's tensors). Its implementation is the eager step
the integer ``handle`` names (registered by the optimizer as a callable, weakly held), so a
compiled step computes exactly what an eager one does, and Dynamo never reads a hyperparameter
float (reading one guards on its value: torch's own optimizers recompile on every learning-rate
change for that reason). The op writes only through the tensors it is given: under
functionalization they may be copies of the parameters, which torch copies back afterwards. It is
tagged ``cudagraph_unsafe``: inductor's CUDA graphs leave it out (docs/replay.md, "A whole iteration
in one graph").
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Dict, List, Optional

import torch

from .ops import NAMESPACE

# handle -> the optimizer's eager step, a bound method held weakly (the table never keeps an
# optimizer alive); called as run(params, step_inputs, grad_scale, found_inf)
_HANDLES: Dict[int, weakref.WeakMethod] = {}
_next = itertools.count(1)

SCHEMA = (
    "optimizer_step(Tensor(a!)[] params, Tensor?[] grads, Tensor?[] step_inputs, Tensor? grad_scale, "
    "Tensor? found_inf, int handle) -> ()"
)


def register(run: Callable[..., None]) -> int:
    """A new handle for an optimizer's eager step ``run``, a bound method (weakly held)."""
    handle = next(_next)

    def forget(_ref: object) -> None:  # the optimizer is gone: so is its handle
        _HANDLES.pop(handle, None)

    _HANDLES[handle] = weakref.WeakMethod(run, forget)
    return handle


def _impl(
    params: List[torch.Tensor],
    grads: List[Optional[torch.Tensor]],
    step_inputs: List[Optional[torch.Tensor]],
    grad_scale: Optional[torch.Tensor],
    found_inf: Optional[torch.Tensor],
    handle: int,
) -> None:
    ref = _HANDLES.get(handle)
    run = ref() if ref is not None else None
    if run is None:
        raise RuntimeError(f"fedopt::optimizer_step: the optimizer of handle {handle} no longer exists")
    run(params, step_inputs, grad_scale, found_inf)


def _fake(params, grads, step_inputs, grad_scale, found_inf, handle) -> None:
    return None


def _declare() -> torch.library.Library:
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    # Inductor's CUDA graphs (torch.compile(mode="reduce-overhead")) replay what they recorded without
    # calling the op again, so what a step does on the host (a round start, a hyperparameter edit, a
    # new decay factor) would never reach a replay: the op keeps out of them and runs every time.
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    lib.define(SCHEMA, tags=() if unsafe is None else (unsafe,))
    lib.impl("optimizer_step", _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::optimizer_step", _fake, lib=lib)
    return lib


# declared at import: Dynamo must find the op, not trace its declaration
_LIB = _declare()
OP = torch.ops.fedopt.optimizer_step
