"""The table of op implementations per backend, which backends register into (``registry.py`` reads it).

A backend module imports this table, never the registry that loads backends, so that loading a
backend imports nothing that loads it back.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .ops import OPS as _SPECS

BACKENDS = ("reference", "triton", "cuda", "cpu")
OPS = tuple(_SPECS)
# a caller that replays steps (replay.py) records a launch whose key was one of its last HISTORY
# eager steps': what a backend keeps per address set (the triton backend's plans) covers as many
HISTORY = 4


class AbsentHere(ImportError):
    """Raised by a backend module that this machine lacks for an expected reason (CUDA code where no
    GPU is visible, an optional package not installed). Its message is the whole reason, which the
    registry shows as it is: an expected absence, not a load failure."""


# op name -> backend name -> implementation
IMPLS: Dict[str, Dict[str, Callable]] = {op: {} for op in OPS}
# backend name -> predicate "can this backend run on tensors of this device?"
DEVICE_OK: Dict[str, Callable[[torch.device], Optional[str]]] = {}


def has(op: str, backend: str) -> bool:
    return backend in IMPLS.get(op, {})


def registered(op: str, backend: str) -> Callable:
    """The implementation ``backend`` registered for ``op`` (KeyError when none)."""
    return IMPLS[op][backend]


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as ``backend``'s implementation of ``op``."""
    if op not in IMPLS:
        raise ValueError(f"unknown op {op!r}; known ops: {OPS}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {BACKENDS}")

    def deco(fn: Callable) -> Callable:
        IMPLS[op][backend] = fn
        return fn

    return deco


def register_device_check(backend: str, check: Callable[[torch.device], Optional[str]]) -> None:
    """``check(device)`` returns None when ``backend`` can run on that device, else a reason."""
    DEVICE_OK[backend] = check
