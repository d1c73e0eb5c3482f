"""The ``triton`` backend: fused multi-tensor Triton kernels for ops sgd, fednar and padamfed.

Runs on CUDA tensors; on CPU tensors only under ``TRITON_INTERPRET=1`` (the Triton interpreter,
which is how the tests check the kernels on machines without a GPU). The kernels live in
``triton_kernels/`` (installed as ``fedopt_kernels.triton_kernels``); this module turns a step's
``Group`` objects into per-role tensor lists, asks the launcher for the cached plan and launches.
Nothing here reads a device value back to the host.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

try:
    import triton  # noqa: F401
except ImportError as exc:  # the registry reports this text as the reason
    raise ImportError(f"triton is not installed ({exc}); pip install 'triton>=3.0'") from exc

from .._batch import Group, StepContext
from .._registry import register, register_device_check


def _import_kernels():
    """``fedopt_kernels.triton_kernels``; from a source checkout without install, load the top-level
    ``triton_kernels/`` folder under that name."""
    name = "fedopt_kernels.triton_kernels"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
    folder = Path(__file__).resolve().parents[2] / "triton_kernels"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot find the Triton kernels ({name} is not installed and {folder} is missing)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_import_kernels()
from fedopt_kernels.triton_kernels import fednar as _fednar  # noqa: E402
from fedopt_kernels.triton_kernels import launcher as _launcher  # noqa: E402
from fedopt_kernels.triton_kernels import padamfed as _padamfed  # noqa: E402
from fedopt_kernels.triton_kernels import sgd as _sgd  # noqa: E402

# Whether the kernels above were created by the interpreter (decided when they were decorated).
_INTERPRETED = _launcher.interpreted()


def _device_check(device: torch.device) -> Optional[str]:
    interp_env = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cuda":
        if _INTERPRETED or interp_env:
            return ("TRITON_INTERPRET=1 runs Triton kernels on the host, which cannot dereference the CUDA "
                    "addresses in the pointer tables; unset TRITON_INTERPRET to use the GPU")
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None
    if device.type == "cpu":
        if not interp_env:
            return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 to interpret them on the CPU)"
        if not _INTERPRETED:
            return ("TRITON_INTERPRET=1 was set after the Triton kernels were imported; set it before "
                    "importing fedopt_kernels")
        return None
    return f"device type {device.type!r} is not supported (CUDA tensors only)"


register_device_check("triton", _device_check)


def _roles(grp: Group, names: Dict[str, str]) -> Dict[str, List[torch.Tensor]]:
    """Role name -> tensor list for one group: params, grads, then the group's tensors renamed."""
    roles = {"x": grp.params, "g": grp.grads}
    for key, role in names.items():
        if key in grp.tensors:
            roles[role] = grp.tensors[key]
    return roles


_SGD_TENSORS = {"momentum_buffer": "buf", "x0": "x0", "correction": "corr", "neuron_scale": "scale"}


@register("sgd", "triton")
def sgd_step(groups: List[Group], ctx: StepContext) -> None:
    device = groups[0].params[0].device
    roles = [_roles(grp, _SGD_TENSORS) for grp in groups]
    plan = _launcher.get_plan("sgd", roles, _sgd.ROLES, _sgd.WRITTEN, device, norm=False, scale_role="scale")
    plan.stage_in(roles)
    k = ctx.k_device(device)
    table = ctx.schedule_table(device)
    for lau in plan.launches:
        _sgd.launch(lau, k, table, ctx.decay_every, groups[lau.group].hp)
    plan.stage_out(roles)


_FEDNAR_TENSORS = {"x0": "x0", "correction": "corr"}


@register("fednar", "triton")
def fednar_step(groups: List[Group], ctx: StepContext) -> None:
    device = groups[0].params[0].device
    roles = [_roles(grp, _FEDNAR_TENSORS) for grp in groups]
    plan = _launcher.get_plan("fednar", roles, _fednar.ROLES, _fednar.WRITTEN, device, norm=True)
    plan.stage_in(roles)
    for lau in plan.launches:
        _fednar.launch_norm(lau, plan, groups[lau.group].hp)
    for lau in plan.launches:
        _fednar.launch_update(lau, plan, groups[lau.group].hp)
    plan.stage_out(roles)


_PADAMFED_TENSORS = {"D": "D", "acc": "acc", "anchor_grad": "H"}


@register("padamfed", "triton")
def padamfed_step(groups: List[Group], ctx: StepContext) -> None:
    device = groups[0].params[0].device
    roles = [_roles(grp, _PADAMFED_TENSORS) for grp in groups]
    for grp, r in zip(groups, roles):
        if grp.hp["variance_reduction"] and "H" not in r:
            raise ValueError("PAdaMFed with variance_reduction=True needs anchor_grad tensors")
    plan = _launcher.get_plan("padamfed", roles, _padamfed.ROLES, _padamfed.WRITTEN, device, norm=True)
    plan.stage_in(roles)
    for lau in plan.launches:
        _padamfed.launch_norm(lau, plan, groups[lau.group].hp)
    for lau in plan.launches:
        _padamfed.launch_update(lau, plan, groups[lau.group].hp)
    plan.stage_out(roles)
