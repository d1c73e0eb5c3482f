"""Glue shared by the compiled backends (``cpu`` and ``cuda``): load an extension module with a
helpful error, and register its ops, one generic wrapper per op of ``ops.OPS``."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Optional

from ..impl_table import register
from ..ops import OPS

_PKG_DIR = Path(__file__).resolve().parents[2]  # fedopt_kernels/, where the extensions live


def status_file(ext: str) -> Path:
    """Where the build writes why ``fedopt_kernels.<ext>`` was not built (see setup.py)."""
    return _PKG_DIR / f"{ext}.build-status.txt"


def torch_release(version: Optional[str] = None) -> str:
    """This torch's MAJOR.MINOR.PATCH, as a build records it (``built_for_torch``): no local or
    pre-release suffix, so "2.12.0a0+git1234" (a nightly) is "2.12.0"."""
    if version is None:
        import torch

        version = str(torch.__version__)
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return ".".join(found.groups()) if found else version


def _say_stale(ext: str, why: str) -> None:
    import warnings

    warnings.warn(f"fedopt_kernels.{ext}: {why}; building it for this torch on first use", RuntimeWarning, stacklevel=3)


def load_extension(ext: str) -> ModuleType:
    """Import ``fedopt_kernels.<ext>``; when the install has none that loads, build it on first use
    (``_jit.py``); raise ImportError saying plainly why it is missing when neither works."""
    install_status = None
    try:
        mod = importlib.import_module(f"fedopt_kernels.{ext}")
    except ImportError as exc:
        status = status_file(ext)
        install_status = status.read_text(encoding="utf-8", errors="replace").strip() if status.is_file() else None
        if install_status:
            packaged = f"it was not built at install time ({install_status})"
        elif isinstance(exc, ModuleNotFoundError) and exc.name == f"fedopt_kernels.{ext}":
            packaged = "this install has no compiled extension (e.g. a wheel built without torch present)"
        else:  # present but unloadable, e.g. built against another torch
            packaged = f"the installed one does not load ({exc})"
    else:
        built_for = getattr(mod, "built_for_torch", None)
        if built_for == torch_release():
            return mod
        # it imported, but torch's C++ ABI and ops change between releases: a build for another
        # torch could fail later or compute with mismatched layouts
        packaged = f"the installed one was built for torch {built_for or 'an unknown version'}, not {torch_release()}"
        _say_stale(ext, packaged)
    from ._jit import JitUnavailable, build

    try:
        return build(ext, install_status)
    except JitUnavailable as jexc:
        raise ImportError(
            f"fedopt_kernels.{ext} is missing: {packaged}, and it cannot be built on first use: {jexc}"
        ) from None


def _wrap(fn, name: str, n_roles: int, backend: str, batched: bool):
    """The registry's calling convention (schema order, optional ``cache``) -> the extension's. A norm
    op on a GPU returns its float64 scratch; with the optimizer's ``cache`` it is handed back the next
    step, so an eager step allocates nothing (an allocation moves where the next gradients land, and
    a replayed step needs them where they were; core/replay.py)."""

    def op(*args, cache=None):
        roles, rest = args[:n_roles], args[n_roles:]
        scratch = cache.get("scratch") if cache is not None else None
        if batched:
            row_of, present, hp, k, table, decay_every, grad_scale, found_inf, active, _backend = rest
            used = fn(roles, row_of, present, hp, k, table, decay_every, grad_scale, found_inf, active, scratch)
        else:
            row_of, present, hp, k, table, decay_every, grad_scale, found_inf, _backend = rest
            used = fn(roles, row_of, present, hp, k, table, decay_every, grad_scale, found_inf, scratch)
        if cache is not None and used is not None:
            cache["scratch"] = used

    op.__name__ = op.__qualname__ = f"{name}_{backend}"
    return op


def register_extension(ext: ModuleType, backend: str) -> None:
    """Register every op ``ext`` implements as ``backend``'s implementation."""
    for name, spec in OPS.items():
        if hasattr(ext, name):
            register(name, backend)(_wrap(getattr(ext, name), name, len(spec.roles), backend, spec.batched))
