"""Optional dependencies: import one, or fail with a message naming the pip extra that installs it.

The core optimizers need only torch and numpy. The simulator's digits data, progress bars and
plots, and the benchmark's charts need the ``[sim]`` / ``[bench]`` extras; a user without them
should read which extra to install, not a bare ``ModuleNotFoundError`` deep in a run.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

# top-level module -> (pip distribution, extras that install it)
KNOWN = {
    "sklearn": ("scikit-learn", "sim"),
    "matplotlib": ("matplotlib", "sim or bench"),
    "tqdm": ("tqdm", "sim"),
}


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message says what needs it and how to install it."""


def hint(module: str) -> str:
    """`pip install ...` advice for an optional module."""
    dist, extras = KNOWN.get(module.split(".")[0], (module.split(".")[0], None))
    if extras is None:
        return f"pip install {dist}"
    first = extras.split()[0]
    return f"pip install 'fedopt_kernels[{first}]' (or just: pip install {dist})"


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtra` saying ``purpose`` needs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the module is there but one of *its* imports is broken: show that as it is
        raise MissingExtra(
            f"{purpose} needs {KNOWN.get(top, (top,))[0]}, which is not installed: {hint(module)}", name=top
        ) from None


def optional(module: str) -> Optional[ModuleType]:
    """Import ``module`` or return None when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != module.split(".")[0]:
            raise
        return None
