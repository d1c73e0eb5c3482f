"""A step plan's per-step check of the tensors it does not own (``plan.py``, docs/replay.md).

Every step, before anything else, a plan must know: is each parameter's gradient the tensor it saw
last time (or a new one of the parameter's shape, dtype, device and layout, which
``zero_grad(set_to_none=True)`` gives every step), does each parameter still have its storage, and
where do the gradients sit. ``GradWatch.check()`` answers in one call: the id of the gradients'
(address, strides) set, equal ids for equal sets, or -1 when the plan must look itself (a gradient
appeared or went, a new one does not fit its parameter, a parameter's storage changed); after looking,
the plan calls ``accept()``.

A watch holds no gradient. A reference to the last step's gradients (as the plan kept before) keeps
their memory from the caching allocator until the next step, so the next backward allocates its
gradients elsewhere: the addresses alternate or drift, launch keys stop repeating and steps stop
replaying. torch's own optimizers hold no gradient, and their loops see one address set.

Two implementations answer alike: the compiled extensions' ``GradWatch`` (``csrc/common/grad_watch.h``),
which walks the tensors in C++ (a step's host time then no longer grows with the number of tensors),
and ``PyGradWatch`` below, with weak references, for parameters the C++ one does not take (tensor
subclasses such as DTensor) and installs without a compiled extension.
"""

from __future__ import annotations

import importlib
import operator
import sys
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .backends._native import torch_release

_GRAD = operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")
_CALL = operator.methodcaller("__call__")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _none() -> None:
    return None


# --------------------------------------------------------------------------- ids of address sets
_interned: dict = {}
_next_id = 1


def _intern(sig: tuple) -> int:
    """A small int for ``sig`` (equal sets, equal ids); the C++ ids start at 2**48, far above these."""
    global _next_id
    ident = _interned.get(sig)
    if ident is None:
        if len(_interned) >= 4096:
            _interned.pop(next(iter(_interned)))  # forget the oldest: seen again, it gets a new id
        ident = _interned[sig] = _next_id
        _next_id += 1
    return ident


class PyGradWatch:
    """``GradWatch`` in Python: weak references to the gradients, C-level maps over the tensors."""

    def __init__(self, params: Sequence[torch.Tensor], order: Sequence[int]):
        self.params = list(params)
        self.kernel_params = [self.params[i] for i in order]
        self.had_grad = [p.grad is not None for p in self.params]
        self.refs: List[Callable[[], Any]] = []
        self.ptrs: List[int] = []
        self.sig: Optional[Tuple[tuple, Any]] = None
        self.id = -1
        self.accept()

    def accept(self) -> int:
        grads = list(map(_GRAD, self.params))
        self.had_grad = [g is not None for g in grads]
        self.refs = [_none if g is None else weakref.ref(g) for g in grads]
        self.ptrs = list(map(_DATA_PTR, self.params))
        kernel = list(map(_GRAD, self.kernel_params))
        self.shapes = list(map(_SHAPE, self.kernel_params))
        self.dtypes = list(map(_DTYPE, self.kernel_params))
        self.devices = list(map(_DEVICE, self.kernel_params))
        self.sig = None
        return self._id(kernel, True)

    def _id(self, grads: List[Optional[torch.Tensor]], new: bool) -> int:
        if any(g is None for g in grads):
            return -1
        kernel: List[torch.Tensor] = grads  # type: ignore[assignment]  # no None left
        ptrs = tuple(map(_DATA_PTR, kernel))
        if not new and self.sig is not None and ptrs == self.sig[0]:
            return self.id
        sig = (ptrs, tuple(map(_STRIDE, kernel)))
        self.sig = sig
        self.id = _intern(sig)
        return self.id

    def check(self) -> int:
        params = self.params
        grads = list(map(_GRAD, params))
        if list(map(_DATA_PTR, params)) != self.ptrs:
            return -1
        if all(map(operator.is_, grads, map(_CALL, self.refs))):
            return self._id(list(map(_GRAD, self.kernel_params)), False)
        # new gradients: accepted without a look at each one when all match their parameters
        kernel = list(map(_GRAD, self.kernel_params))
        if (
            [g is not None for g in grads] != self.had_grad
            or list(map(_LAYOUT, kernel)) != [torch.strided] * len(kernel)
            or list(map(_SHAPE, kernel)) != self.shapes
            or list(map(_DTYPE, kernel)) != self.dtypes
            or list(map(_DEVICE, kernel)) != self.devices
        ):
            return -1
        self.refs = [_none if g is None else weakref.ref(g) for g in grads]
        return self._id(kernel, True)


# --------------------------------------------------------------------------- which one
_native: Any = False  # not looked for yet
# the release an extension built for this torch records (the running torch cannot change)
_THIS_TORCH = torch_release()


def _native_module() -> Any:
    """A compiled extension with ``GradWatch``, already loaded or importable as built; never a build."""
    global _native
    if _native is False:
        _native = None
        for name in ("fedopt_kernels._C_cuda", "fedopt_kernels._C_cpu"):
            mod = sys.modules.get(name)
            if mod is None and name.endswith("_C_cpu"):
                try:
                    mod = importlib.import_module(name)
                except ImportError:
                    mod = None
            if mod is not None and hasattr(mod, "GradWatch") and getattr(mod, "built_for_torch", None) == _THIS_TORCH:
                _native = mod
                break
    return _native


def make(params: Sequence[torch.Tensor], order: Sequence[int]) -> Any:
    """The watch for a plan over ``params`` (kernel order ``order``): the compiled one for plain tensors."""
    native = _native_module()
    if native is not None and all(type(p) in _PLAIN for p in params):
        return native.GradWatch(list(params), list(order))
    return PyGradWatch(params, order)
