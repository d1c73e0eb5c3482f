"""Glue shared by the compiled backends (``cpu`` and ``cuda``): load an extension module with a
helpful error, and turn ``Group`` batches into the argument lists the C++ ops take
(``csrc/common/op_args.h`` documents them)."""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import List, Tuple

from .._batch import Group, StepContext

_PKG_DIR = Path(__file__).resolve().parent.parent


def status_file(ext: str) -> Path:
    """Where the build writes why ``fedopt_kernels.<ext>`` was not built (see setup.py)."""
    return _PKG_DIR / f"{ext}.build-status.txt"


def load_extension(ext: str) -> ModuleType:
    """Import ``fedopt_kernels.<ext>``; when the install has none that loads, build it on first use
    (``_jit.py``); raise ImportError saying plainly why it is missing when neither works."""
    try:
        return importlib.import_module(f"fedopt_kernels.{ext}")
    except ImportError as exc:
        status = status_file(ext)
        install_status = status.read_text(encoding="utf-8", errors="replace").strip() if status.is_file() else None
        if install_status:
            packaged = f"it was not built at install time ({install_status})"
        elif isinstance(exc, ModuleNotFoundError) and exc.name == f"fedopt_kernels.{ext}":
            packaged = "this install has no compiled extension (e.g. a wheel built without torch present)"
        else:  # present but unloadable, e.g. built against another torch
            packaged = f"the installed one does not load ({exc})"
    from ._jit import JitUnavailable, build

    try:
        return build(ext, install_status)
    except JitUnavailable as jexc:
        raise ImportError(f"fedopt_kernels.{ext} is missing: {packaged}, and it cannot be built on first use: "
                          f"{jexc}") from None


def _lists(grp: Group, names: Tuple[str, ...]) -> List[list]:
    t = grp.tensors
    return [grp.params, grp.grads] + [t.get(name, []) for name in names]


def sgd_args(groups: List[Group]) -> Tuple[list, list]:
    """[params, grads, momentum_buffer, x0, correction, neuron_scale] and
    [lr, momentum, dampening, weight_decay, prox_mu, nesterov, maximize] per group."""
    lists, hps = [], []
    for grp in groups:
        hp = grp.hp
        lists.append(_lists(grp, ("momentum_buffer", "x0", "correction", "neuron_scale")))
        hps.append([float(hp["lr"]), float(hp["momentum"]), float(hp["dampening"]), float(hp["weight_decay"]),
                    float(hp.get("prox_mu", 0.0)), float(bool(hp["nesterov"])), float(bool(hp["maximize"]))])
    return lists, hps


def fednar_args(groups: List[Group]) -> Tuple[list, list]:
    """[params, grads, x0, correction] and [step_lr, weight_decay, max_norm, eps, prox_mu] per group."""
    lists, hps = [], []
    for grp in groups:
        hp = grp.hp
        lists.append(_lists(grp, ("x0", "correction")))
        hps.append([float(hp["step_lr"]), float(hp["weight_decay"]), float(hp["max_norm"]), float(hp["eps"]),
                    float(hp.get("prox_mu", 0.0))])
    return lists, hps


def padamfed_args(groups: List[Group]) -> Tuple[list, list]:
    """[params, grads, D, acc, anchor_grad] and [lr, beta, eps, variance_reduction] per group."""
    lists, hps = [], []
    for grp in groups:
        hp = grp.hp
        lists.append(_lists(grp, ("D", "acc", "anchor_grad")))
        hps.append([float(hp["lr"]), float(hp["beta"]), float(hp["eps"]), float(bool(hp["variance_reduction"]))])
    return lists, hps


def make_ops(ext: ModuleType, backend: str):
    """The three op functions ``fn(groups, ctx)`` calling ``ext``; ``backend`` names the registry entry."""

    def sgd_step(groups: List[Group], ctx: StepContext) -> None:
        dev = groups[0].params[0].device
        lists, hps = sgd_args(groups)
        ext.sgd(lists, hps, ctx.k_device(dev), ctx.schedule_table(dev), int(ctx.decay_every))

    def fednar_step(groups: List[Group], ctx: StepContext) -> None:
        lists, hps = fednar_args(groups)
        ext.fednar(lists, hps)

    def padamfed_step(groups: List[Group], ctx: StepContext) -> None:
        lists, hps = padamfed_args(groups)
        ext.padamfed(lists, hps)

    for fn, op in ((sgd_step, "sgd"), (fednar_step, "fednar"), (padamfed_step, "padamfed")):
        fn.__name__ = f"{op}_{backend}"
        fn.__qualname__ = fn.__name__
    return sgd_step, fednar_step, padamfed_step
