"""The op declarations the kernels are built from, handed over by the backend that loads them.

Each kernel module turns an op's roles (the pointer table's columns) and hp columns into
``tl.constexpr`` module constants when it is imported (``spec_roles``, ``spec_slots``,
``spec_columns``). Those come from the op's one declaration (``fedopt_kernels/core/ops.py``), which
``fedopt_kernels.core.backends.triton`` hands over (``declare``) before it imports any kernel
module: the kernels import nothing of the package that loads them. A declaration is read where it
is given, so a test that edits it is seen by the next constant made.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional, Tuple

import triton.language as tl

# op name -> its declaration (an object with ``roles``, each with ``short`` and ``written``, ``hps``
# and ``hp_index``): core/ops.py's OPS, given by the backend
_DECLARED: Optional[Mapping[str, Any]] = None


# how a failed kernel-side path is reported: core/fallbacks.py's fall_back (record, warn once), given
# by the backend; a plain warning until then
_FALL_BACK: Optional[Callable[[str, BaseException, str, int], Any]] = None


def declare(ops: Mapping[str, Any], fall_back: Optional[Callable[[str, BaseException, str, int], Any]] = None) -> None:
    """The declarations of every op (``fedopt_kernels.core.ops.OPS``), before a kernel module is
    imported, and the package's fallback record (``fedopt_kernels.core.fallbacks.fall_back``)."""
    global _DECLARED, _FALL_BACK
    _DECLARED = ops
    _FALL_BACK = fall_back


def fall_back(choice: str, exc: BaseException, instead: str, stacklevel: int = 3) -> None:
    """``choice`` failed with ``exc``: ``instead`` runs from now on; recorded and warned once."""
    if _FALL_BACK is not None:
        _FALL_BACK(choice, exc, instead, stacklevel + 1)
        return
    warnings.warn(f"{choice} failed ({type(exc).__name__}: {exc}); {instead} from now on", RuntimeWarning, stacklevel)


def _spec(op: str) -> Any:
    if _DECLARED is None:
        raise RuntimeError(
            "the Triton kernels read their ops' declarations from fedopt_kernels.core.backends.triton: "
            "import that module before the kernels"
        )
    return _DECLARED[op]


def spec_roles(op: str) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(role short names, written role short names) of ``op``, from its one declaration (``core/ops.py``)."""
    spec = _spec(op)
    return tuple(r.short for r in spec.roles), tuple(r.short for r in spec.roles if r.written)


def spec_slots(op: str, *shorts: str) -> Tuple[tl.constexpr, ...]:
    """The role slots (tensor-list positions) of ``op``'s roles ``shorts``, as kernel constants."""
    roles, _ = spec_roles(op)
    missing = [s for s in shorts if s not in roles]
    if missing:
        raise KeyError(f"op {op!r} has no role {missing} (its roles: {roles})")
    return tuple(tl.constexpr(roles.index(s)) for s in shorts)


def spec_columns(op: str, *names: str) -> Tuple[tl.constexpr, ...]:
    """The hp columns of ``op``'s hyperparameters ``names``, as kernel constants; then the column count."""
    spec = _spec(op)
    return tuple(tl.constexpr(spec.hp_index(n)) for n in names) + (tl.constexpr(len(spec.hps)),)
