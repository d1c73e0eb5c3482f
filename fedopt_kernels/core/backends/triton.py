"""The ``triton`` backend: fused multi-tensor Triton kernels for every op of ``ops.OPS``.

Runs on CUDA tensors; on CPU tensors only under ``TRITON_INTERPRET=1`` (the Triton interpreter,
which is how the tests check the kernels on machines without a GPU). The kernels live in
``triton_kernels/`` (installed as ``fedopt_kernels.triton_kernels``); this module turns an op's
arguments into per-row-group role lists, asks ``plans`` for the launch plan (pointer tables, chunk
maps) and launches on the tensors' device (``launcher.device_guard``). Nothing here reads a device value
back to the host.

With a ``cache`` from the optimizer, the plan is reused without re-reading every tensor's address:
only the gradients (and per-step inputs) may differ between calls, and their addresses are compared.
Gradients at new addresses with the same layout get the cached plan with their pointer-table
column rewritten (``LaunchPlan.moved``), not a plan built from scratch.

The client-batched ops (``<op>_batched``) run the same kernels over client slices of stacked
tensors (``plans.get_batched_plan``; design in ``docs/triton_batched.md``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..impl_table import AbsentHere, register, register_device_check

try:
    import triton  # noqa: F401
except ModuleNotFoundError as exc:  # an optional extra, not a failure; a broken triton says why as it is
    if exc.name != "triton":
        raise
    raise AbsentHere("not installed: the triton package is an extra (pip install 'fedopt_kernels[triton]')") from exc

from .. import fallbacks
from ..between_passes import current as _sharded
from ..impl_table import HISTORY
from ..ops import FRESH, OPS
from ..reference import OpArgs


def _import_kernels():
    """``fedopt_kernels.triton_kernels``: in a source checkout (``setup.py`` beside the package), the
    checkout's own top-level ``triton_kernels/`` folder, loaded under that name, so that a checkout
    runs its own kernels even where another checkout of the package is installed in editable mode;
    else the installed kernels."""
    name = "fedopt_kernels.triton_kernels"
    top = Path(__file__).resolve().parents[3]
    folder = top / "triton_kernels"
    checkout = (top / "setup.py").is_file() and (folder / "launcher.py").is_file()
    if not checkout or name in sys.modules:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot find the Triton kernels ({name} is not installed and {folder} is missing)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_import_kernels()
from fedopt_kernels.triton_kernels import declarations as _declarations  # noqa: E402

# before any kernel module is imported: they make their constants from it
_declarations.declare(OPS, fallbacks.fall_back)
from fedopt_kernels.triton_kernels import launcher as _launcher  # noqa: E402
from fedopt_kernels.triton_kernels import plans as _plans  # noqa: E402
from fedopt_kernels.triton_kernels import two_pass as _two_pass  # noqa: E402
from fedopt_kernels.triton_kernels.jit_mode import interpreted as _interpreted  # noqa: E402

# Whether the kernels above were created by the interpreter (decided when they were decorated).
_INTERPRETED = _interpreted()


def _device_check(device: torch.device) -> Optional[str]:
    interp_env = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cuda":
        if _INTERPRETED or interp_env:
            return (
                "TRITON_INTERPRET=1 runs Triton kernels on the host, which cannot dereference the CUDA "
                "addresses in the pointer tables; unset TRITON_INTERPRET to use the GPU"
            )
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None
    if device.type == "cpu":
        if not interp_env:
            return "Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 to interpret them on the CPU)"
        if not _INTERPRETED:
            return (
                "TRITON_INTERPRET=1 was set after the Triton kernels were imported; set it before "
                "importing fedopt_kernels"
            )
        return None
    return f"device type {device.type!r} is not supported (CUDA tensors only)"


register_device_check("triton", _device_check)


def _amp(a: OpArgs) -> Dict[str, Any]:
    """GradScaler's tensors as kernel arguments (the k tensor stands in for an absent one: never read)."""
    return {
        "scale": a.grad_scale if a.grad_scale is not None else a.k,
        "found": a.found_inf if a.found_inf is not None else a.k,
        "UNSCALE": a.grad_scale is not None,
        "SKIPPABLE": a.found_inf is not None,
    }


def _active(a: OpArgs) -> Optional[torch.Tensor]:
    """The batched ops' active mask, which the kernels read on the parameters' device."""
    if a.active is not None and a.active.device != a.device:
        raise ValueError(f"fedopt::{a.spec.name}: active is on {a.active.device} but the parameters are on {a.device}")
    return a.active


def _hp(a: OpArgs) -> torch.Tensor:
    """hp with contiguous rows (the kernels address row ``r`` at ``r * len(hps)``)."""
    return a.hp if a.hp.is_contiguous() else a.hp.contiguous()


def _roles(a: OpArgs):
    """Per row group: role short name -> tensor list; and each row group's hp row."""
    short = {r.name: r.short for r in a.spec.roles}
    groups = a.row_groups()
    return [{short[name]: ts for name, ts in b.tensors.items()} for b in groups], [b.row for b in groups]


def _per_step_ptrs(a: OpArgs, per_step: List[str], grad_set: Optional[int]) -> tuple:
    """The addresses of the tensors that may change between an optimizer's steps. ``grad_set``: the
    optimizer's id of the gradients' address set (core/grad_watch.py), which stands for theirs."""
    if grad_set is None:
        ptrs: tuple = tuple([t.data_ptr() for name in per_step for t in a.lists[name]])
    else:
        ptrs = (grad_set,) + tuple([t.data_ptr() for name in per_step[1:] for t in a.lists[name]])
    # batched: the FRESH bits are in the plan too (they change with the round, the tensors may not)
    return (ptrs, tuple(a.present)) if a.spec.batched else ptrs


def _per_step_layout(a: OpArgs, per_step: List[str]) -> tuple:
    """What a plan fixes about the per-step tensors besides their addresses: dtypes, strides and 16-byte
    alignment (which tensors are staged, which launches keep the 128-bit promise), and the FRESH bits."""
    layout = tuple((t.dtype, t.stride(), t.data_ptr() % 16) for name in per_step for t in a.lists[name])
    return (layout, tuple(a.present))


# plans an optimizer keeps for the address sets of its per-step tensors (gradients): the caching
# allocator may hand a loop's gradients a few sets in turn, and a step replay records (a key among
# the last HISTORY eager steps' of this plan) must find its plan here, never build one while
# capturing. Since such a key's eager step, at most HISTORY - 1 other eager steps and as many
# recordings have called the backend, each maybe with other addresses: 2 * HISTORY covers them.
MOVED_PLANS = 2 * HISTORY


class _OpRoles(NamedTuple):
    """What the launcher needs to know of an op's roles (from its declaration, worked out once)."""

    names: Tuple[str, ...]  # role short names: the pointer table's columns
    written: Tuple[str, ...]  # roles the op stores into
    scale_role: Optional[str]  # the per-row role, if any
    per_step: List[str]  # role names whose tensors may change between an optimizer's steps
    moving: List[str]  # their short names


@functools.cache
def _op_roles(op: str) -> _OpRoles:
    spec = OPS[op]
    # with the optimizer's cache only these lists can have changed since the plan was built
    per_step = ["grads"] + [r.name for r in spec.optional if not r.written and r.name == "anchor_grad"]
    short = {r.name: r.short for r in spec.roles}
    return _OpRoles(
        tuple(r.short for r in spec.roles),
        tuple(r.short for r in spec.roles if r.written),
        next((r.short for r in spec.roles if r.per_row), None),
        per_step,
        [short[name] for name in per_step],
    )


def _capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on ``device``'s current stream?"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _refuse_new_tables(device: torch.device) -> None:
    """New pointer tables are copied from the host, which a capture cannot hold: refuse, saying why
    (mostly gradients a capture's own backward made, after zero_grad(set_to_none=True))."""
    if _capturing(device):
        raise RuntimeError(
            "the triton backend needs new pointer tables for tensors no eager step has seen, and cannot "
            "make them inside a CUDA graph capture; this happens to gradients made by the captured "
            "backward after zero_grad(set_to_none=True). Keep the warm-up's gradients instead: call "
            'opt.zero_grad(set_to_none=False) before the capture and inside it (docs/replay.md, "A whole '
            "iteration in one graph\"), or use backend='cuda'"
        )


def _plan(a: OpArgs, cache: Optional[Dict[str, Any]]) -> _plans.LaunchPlan:
    spec = a.spec
    names, written, scale_role, per_step, moving = _op_roles(spec.name)
    ptrs = _per_step_ptrs(a, per_step, cache.get("grad_set")) if cache is not None else None
    if cache is not None and "plan" in cache:
        if cache["ptrs"] == ptrs:
            return cache["plan"]
        known = cache["by_ptrs"]
        plan = known.get(ptrs)
        if plan is None and cache["layout"] == _per_step_layout(a, per_step):
            # moved gradients: the cached plan with their table columns rewritten (plans.LaunchPlan.moved)
            _refuse_new_tables(a.device)
            plan = cache["plan"].moved(_roles(a)[0], moving)
            _plans.stats["moved"] += 1
        if plan is not None:
            known[ptrs] = plan
            known.move_to_end(ptrs)
            while len(known) > MOVED_PLANS:
                known.popitem(last=False)
            cache["plan"], cache["ptrs"] = plan, ptrs
            return plan
    roles, rows = _roles(a)
    for r in roles:
        for role, ts in r.items():
            for t in ts:
                _launcher.tl_dtype(t, role)
    if spec.batched:
        fresh = [bool(a.present[b] & FRESH) for b in rows]
        plan = _plans.get_batched_plan(
            spec.name, roles, rows, fresh, a.hp.shape[1], a.hp.shape[0], names, written, a.device, spec.norm, scale_role
        )
    else:
        plan = _plans.get_plan(spec.name, roles, rows, names, written, a.device, spec.norm, scale_role)
    if cache is not None:
        cache["plan"], cache["ptrs"] = plan, ptrs
        cache["by_ptrs"] = OrderedDict([(ptrs, plan)])
        cache["layout"] = _per_step_layout(a, per_step)
    return plan


def _stage_roles(a: OpArgs, plan, cache):
    if not plan.staged:
        return None
    return _roles(a)[0]


def _step_key(a: OpArgs, hp: torch.Tensor, amp: Dict[str, Any], active: Optional[torch.Tensor]) -> tuple:
    """What a step's launches take besides their plan's tensors (``launcher.launch``): addresses of
    the step's own tensors, the scalars, and the flags that pick a kernel variant."""
    return (
        hp.data_ptr(),
        a.k.data_ptr(),
        a.k.numel(),
        a.table.data_ptr(),
        a.table.numel(),
        a.decay_every,
        amp["scale"].data_ptr(),
        amp["found"].data_ptr(),
        amp["UNSCALE"],
        amp["SKIPPABLE"],
        None if active is None else active.data_ptr(),
    )


def _op(name: str, launch_all):
    """Register ``name``'s Triton implementation: parse, plan, stage what the plan stages, run
    ``launch_all(args, plan, hp, amp, active, step_key)`` (every launch of the step, k += 1
    included), unstage."""

    def step(*args, cache=None) -> None:
        # an optimizer's cache belongs to one step plan: its structure was checked at the first call
        a = OpArgs.parse(OPS[name], args, checked=cache is not None and cache.get("checked", False))
        if cache is not None:
            cache["checked"] = True
        active = _active(a)
        with _launcher.device_guard(a.device):
            plan = _plan(a, cache)
            roles = _stage_roles(a, plan, cache)
            if roles is not None:
                plan.stage_in(roles)
            hp, amp = _hp(a), _amp(a)
            launch_all(a, plan, hp, amp, active, _step_key(a, hp, amp, active))
            if roles is not None:
                plan.stage_out(roles)

    step.__name__ = step.__qualname__ = f"{name}_triton"
    return register(name, "triton")(step)


def _one_pass_launches(kernels):
    """A one-pass op (``sgd`` and its batched form): one update launch of ``kernels.launch`` per
    launch of the plan, then k += 1 (per active client) on the device. The batched op is the same
    kernel over client slices."""

    def launch_all(
        a: OpArgs, plan, hp: torch.Tensor, amp: Dict[str, Any], active: Optional[torch.Tensor], step_key: tuple
    ) -> None:
        for lau in plan.launches:
            kernels.launch(lau, a.k, a.table, a.decay_every, hp, amp, active, step_key)
        _two_pass.advance(a.k, amp, active, plan.bound, step_key)

    return launch_all


def _norm_launches(
    a: OpArgs, plan, hp: torch.Tensor, amp: Dict[str, Any], active: Optional[torch.Tensor], step_key: tuple
) -> None:
    """A norm op (``fednar``/``padamfed``) and its batched form: norm pass, (batched: per-client
    finalize), update pass, through the two-pass driver; sharded parameters' norm slots are reduced
    over the ranks between the passes (``between_passes.reducing``)."""
    reduce = getattr(_sharded, "reduce", None)
    _two_pass.launch(a.spec.base or a.spec.name, plan, hp, a.k, amp, active, step_key, reduce)


def _launches_of(spec) -> Any:
    """Every op of the declaration runs: a norm op through the two-pass driver, a one-pass op through
    ``triton_kernels/<op>.py``'s ``launch``."""
    if spec.norm:
        return _norm_launches
    return _one_pass_launches(importlib.import_module(f"fedopt_kernels.triton_kernels.{spec.base or spec.name}"))


# one registered step per declared op (per-client and client-batched)
STEPS = {name: _op(name, _launches_of(spec)) for name, spec in OPS.items()}
