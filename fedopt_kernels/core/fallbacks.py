"""Fallbacks: a GPU-only path that failed, dropped for the run, and the proven path that ran instead.

Every path that only a GPU takes and that a device, a driver or a library may refuse (a CUDA graph
capture, a bound Triton launch, a formulation, chunk size or compiled step the client-batched
engine measured) catches the failure at its one place, drops that choice for the rest of the run,
warns once naming the choice and the error (``fall_back``), and records it here, so that a run's
results can say which paths it did not take and why (``taken``). An error that is the caller's (bad
shapes, NaN) is not caught: the proven path raises it too.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, List

MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Fallback:
    """One dropped choice: what it was, what it raised, what runs instead."""

    choice: str
    error: str
    instead: str

    def to_json(self) -> Dict[str, str]:
        return {"choice": self.choice, "error": self.error, "instead": self.instead}


_TAKEN: List[Fallback] = []  # in this process, in order; a run reports those since its start (mark)


def describe(exc: BaseException) -> str:
    """``Type: first line`` of an error, at most ``MAX_ERROR_CHARS`` characters."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:MAX_ERROR_CHARS]


def record(choice: str, exc: BaseException, instead: str) -> Fallback:
    """Record a fallback without a warning (for a caller that warns in words of its own)."""
    taken = Fallback(choice, describe(exc), instead)
    _TAKEN.append(taken)
    return taken


def fall_back(choice: str, exc: BaseException, instead: str, stacklevel: int = 3) -> Fallback:
    """Record a fallback and warn once (a ``RuntimeWarning``) naming ``choice`` and the error."""
    taken = record(choice, exc, instead)
    warnings.warn(
        f"fedopt_kernels: {choice} failed ({taken.error}); {instead} for the rest of the run",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
    return taken


def mark() -> int:
    """Where a run starts in this process's record: ``taken(mark())`` at its end is its own."""
    return len(_TAKEN)


def taken(since: int = 0) -> List[Dict[str, str]]:
    """The fallbacks recorded since ``since`` (``mark``), as plain data for a run's results."""
    return [f.to_json() for f in _TAKEN[since:]]
