"""``fedopt::optimizer_step``: a whole ``step()`` as one opaque op, which is what torch.compile sees.

Under ``torch.compile`` an optimizer's ``step()`` reduces to this op over its parameters and their
gradients (plus per-step inputs and GradScaler's tensors). Its implementation is the eager
``step()`` of the optimizer the integer ``handle`` names, so a compiled step computes exactly what
an eager one does, and Dynamo never reads a hyperparameter float (reading one guards on its value:
torch's own optimizers recompile on every learning-rate change for that reason). The op writes
only through the tensors it is given: under functionalization they may be copies of the
parameters, which torch copies back afterwards.
"""
from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from ._ops import NAMESPACE

if TYPE_CHECKING:  # pragma: no cover
    from ._base import FedOptimizer

_HANDLES: Dict[int, "weakref.ref[FedOptimizer]"] = {}
_next = itertools.count(1)

SCHEMA = ("optimizer_step(Tensor(a!)[] params, Tensor?[] grads, Tensor?[] step_inputs, Tensor? grad_scale, "
          "Tensor? found_inf, int handle) -> ()")


def register(opt: "FedOptimizer") -> int:
    """A new handle for ``opt`` (weakly held: the table never keeps an optimizer alive)."""
    handle = next(_next)
    _HANDLES[handle] = weakref.ref(opt, lambda _ref, h=handle: _HANDLES.pop(h, None))
    return handle


def _impl(params: List[torch.Tensor], grads: List[Optional[torch.Tensor]], step_inputs: List[Optional[torch.Tensor]],
          grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor], handle: int) -> None:
    ref = _HANDLES.get(handle)
    opt = ref() if ref is not None else None
    if opt is None:
        raise RuntimeError(f"fedopt::optimizer_step: the optimizer of handle {handle} no longer exists")
    opt._run(params, step_inputs, grad_scale, found_inf)


def _fake(params, grads, step_inputs, grad_scale, found_inf, handle) -> None:
    return None


def _declare() -> torch.library.Library:
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    lib.define(SCHEMA)
    lib.impl("optimizer_step", _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::optimizer_step", _fake, lib=lib)
    return lib


# declared at import: Dynamo must find the op, not trace its declaration
_LIB = _declare()
OP = torch.ops.fedopt.optimizer_step
