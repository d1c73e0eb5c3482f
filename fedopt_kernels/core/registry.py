"""Backend registry: each op is declared once (``ops.py``), implementations are registered per backend.

An implementation of op ``name`` takes the op's arguments in schema order (``ops.OpSpec.schema``)
and may accept a keyword ``cache``: a dict the caller keeps for the same tensors across steps (the
optimizers pass one; ``torch.ops.fedopt.<op>`` calls pass none). The ``reference`` implementation
is plain PyTorch and always present; ``triton``, ``cuda`` and ``cpu`` register themselves from
``fedopt_kernels.core.backends.<name>`` when their import succeeds. A backend whose import fails records
*why*, and ``available_backends()`` reports it. Backends register into the table of
``impl_table.py`` (re-exported here), which imports nothing that loads them.

The optimizer classes never mention a backend by name: they ask ``resolve(op, backend, device)``.
This module also installs the kernel behind every ``torch.ops.fedopt.<op>``: the implementation
its ``backend`` argument names.
"""

from __future__ import annotations

import importlib
import os
from typing import Callable, Dict, Optional

import torch

from .impl_table import (  # noqa: F401
    BACKENDS,
    DEVICE_OK,
    IMPLS,
    OPS,
    AbsentHere,
    has,
    register,
    register_device_check,
)
from .ops import NAMESPACE

# backend name -> None when loaded fine, else why it is not usable (a clause after "backend 'x' ")
_LOAD_ERRORS: Dict[str, Optional[str]] = {}


def _load(backend: str) -> Optional[str]:
    """Import ``fedopt_kernels.core.backends.<backend>`` once; return None or the failure reason."""
    if backend in _LOAD_ERRORS:
        return _LOAD_ERRORS[backend]
    if backend == "reference":
        importlib.import_module("fedopt_kernels.core.reference")
        _LOAD_ERRORS[backend] = None
        return None
    env = os.environ.get(f"FEDOPT_DISABLE_{backend.upper()}", "")
    if env not in ("", "0"):
        _LOAD_ERRORS[backend] = f"disabled by FEDOPT_DISABLE_{backend.upper()}={env}"
        return _LOAD_ERRORS[backend]
    try:
        importlib.import_module(f"fedopt_kernels.core.backends.{backend}")
        _LOAD_ERRORS[backend] = None
    except AbsentHere as exc:  # expected on this machine (no GPU, an extra not installed): said as it is
        _LOAD_ERRORS[backend] = str(exc)
    except Exception as exc:  # any failure means "not usable here"; keep the reason for the user
        _LOAD_ERRORS[backend] = f"failed to load ({type(exc).__name__}: {exc})"
    return _LOAD_ERRORS[backend]


def unavailable_reason(backend: str, device: Optional[torch.device] = None, op: Optional[str] = None) -> Optional[str]:
    """None when ``backend`` can run ``op`` on ``device``; otherwise a sentence saying why not."""
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; choose one of {('auto',) + BACKENDS}"
    err = _load(backend)
    if err is not None:
        return f"backend {backend!r} {err}"
    if op is not None and backend not in IMPLS[op]:
        return f"backend {backend!r} has no implementation of op {op!r}"
    if device is not None and backend in DEVICE_OK:
        why = DEVICE_OK[backend](torch.device(device))
        if why is not None:
            return f"backend {backend!r} cannot run on {device}: {why}"
    return None


def auto_backend(device: torch.device, op: str) -> str:
    """docs/backends.md: CUDA tensors -> cuda if built, else triton; CPU tensors -> cpu if built, else reference."""
    order = ("cuda", "triton") if device.type == "cuda" else ("cpu",)
    for name in order:
        if unavailable_reason(name, device, op) is None:
            return name
    return "reference"


def resolve(op: str, backend: str, device: torch.device) -> Callable:
    """The implementation of ``op`` for ``backend`` (or ``"auto"``) on ``device``; raises if unusable."""
    name = auto_backend(device, op) if backend == "auto" else backend
    why = unavailable_reason(name, device, op)
    if why is not None:
        raise RuntimeError(f"backend={name!r} is not available: {why}")
    return IMPLS[op][name]


def implementation(op: str, backend: str, device: torch.device) -> Callable:
    """Like ``resolve`` but raising ValueError (the ``torch.ops.fedopt`` entry point's bad input)."""
    try:
        return resolve(op, backend, device)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None


class AvailableBackends(tuple):
    """The usable backend names (a tuple), with ``.missing``: name -> why it is not usable."""

    missing: Dict[str, str]

    def __new__(cls, usable, missing):
        obj = super().__new__(cls, usable)
        obj.missing = dict(missing)
        return obj

    def __repr__(self) -> str:
        lines = [f"available: {', '.join(self)}"]
        lines += [f"  {name}: {why}" for name, why in self.missing.items()]
        return "\n".join(lines)


def available_backends(device: Optional[str | torch.device] = None) -> AvailableBackends:
    """The backends usable on this machine (for ``device``, default: CUDA if present else CPU),
    with ``.missing`` giving the reason each other backend is not usable."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    usable, missing = [], {}
    for name in BACKENDS:
        why = unavailable_reason(name, torch.device(device))
        if why is None:
            usable.append(name)
        else:
            missing[name] = why
    return AvailableBackends(usable, missing)


# ------------------------------------------------------------------------------- torch.library
def _make_impl(name: str) -> Callable:
    def impl(*args):
        return implementation(name, args[-1], args[0][0].device if args[0] else torch.device("cpu"))(*args)

    impl.__name__ = f"{name}_dispatch"
    return impl


def _install() -> torch.library.Library:
    """The kernel of every op ``ops.py`` declares forwards to the implementation of its ``backend``
    argument, so ``torch.ops.fedopt.sgd(..., backend="cpu")`` and an optimizer with backend "cpu"
    run the same code."""
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name in OPS:
        lib.impl(name, _make_impl(name), "CompositeExplicitAutograd")
    return lib


_LIB = _install()
