"""The shared multi-tensor launcher: one kernel launch covers every tensor of a pass.

What a launch covers is its plan's (``plans.py``: pointer tables, chunk maps, tiles, staging, the plan
cache, norm slots). This module holds what the launches of every op share besides:

* **Element types as kernel constants.** ``tl_dtype`` gives a tensor's element type as a
  ``tl.constexpr`` (so a plan launches once per dtype signature), and refuses other dtypes, naming
  the role (``ROLE_NAMES``); the op's role slots and hp columns are ``declarations.py``'s.
* **Bound launches.** Triton's ``kernel[grid](*args, **kwargs)`` binds every argument, works out its
  specialisation and looks the compiled kernel up at each launch: most of an eager step's host time.
  ``launch`` does that once per launch of a plan and calls the compiled kernel directly afterwards,
  with the arguments it bound (addresses as integers), while the step's own inputs (``step_key``:
  the addresses of hp, k, the schedule table and the AMP tensors, the scalars, the flags) are the
  ones it was bound with. That call is triton's private positional ``run``: it is made only on the
  triton versions whose ``run`` was read (``BIND_CHECKED``), and a call (or a binding) that fails
  turns binding off for the process with one warning (the package's ``core/fallbacks.py``, handed
  over as ``declarations.fall_back``) and the launch goes through triton's own path, then and from
  then on.
* **Device and options.** ``device_guard`` makes the tensors' GPU current for a step;
  ``launch_options`` are the compile options of every launch.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from . import declarations

# Warps of a compiled program: 8 for ``plans.GPU_BLOCK``'s 2048 elements, 8 elements per thread.
GPU_NUM_WARPS = 8

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# how error messages name the kernels' roles
ROLE_NAMES = {
    "x": "parameter",
    "g": "gradient",
    "buf": "momentum_buffer",
    "x0": "x0 (FedProx anchor)",
    "corr": "correction",
    "scale": "neuron_scale",
    "D": "D",
    "acc": "acc",
    "H": "anchor_grad",
}


def tl_dtype(t: torch.Tensor, role: str, backend: str = "triton") -> tl.dtype:
    """The Triton element type of ``t``; TypeError naming the role and dtype when unsupported."""
    try:
        return _TL_DTYPES[t.dtype]
    except KeyError:
        raise TypeError(
            f"backend={backend!r} supports float32, float16 and bfloat16 tensors, but a "
            f"{ROLE_NAMES.get(role, role)} has dtype {t.dtype} (use backend='reference' "
            f"or 'cpu' for {t.dtype})"
        ) from None


class Bound:
    """A compiled kernel with the arguments of one launch, bound at its first launch (``launch``)."""

    __slots__ = ("run", "function", "packed", "grid", "args", "step_key")

    def __init__(self, compiled: Any, grid: Tuple[int, ...], args: tuple, step_key: tuple):
        self.run = compiled.run
        self.function = compiled.function
        self.packed = compiled.packed_metadata
        self.grid = (grid + (1, 1))[:3]
        self.args = args
        self.step_key = step_key


# the first and last triton (major, minor) whose compiled kernels' ``run`` was read to take
# (grid x, y, z, stream, function, packed metadata, launch metadata, enter hook, exit hook, *every
# argument in parameter order) and whose launch hooks are ``triton.knobs.runtime``'s: a bound launch
# calls it so; any other triton takes its own path
BIND_CHECKED = ((3, 6), (3, 8))


def _version(text: str) -> Tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def bind_allowed(version: Optional[str] = None) -> bool:
    """``FEDOPT_TRITON_BIND`` is not off and this triton is one whose ``run`` was read (``BIND_CHECKED``)."""
    if os.environ.get("FEDOPT_TRITON_BIND", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if getattr(getattr(triton, "knobs", None), "runtime", None) is None:  # where _hooks reads the hooks
        return False
    return BIND_CHECKED[0] <= _version(triton.__version__ if version is None else version) <= BIND_CHECKED[1]


_BIND = bind_allowed()


def _hooks() -> bool:
    """Launch hooks (a profiler such as proton) are set: they need triton's own launch path. Triton
    3.6 keeps them in a ``HookChain``, present and empty when none is set (a triton without
    ``triton.knobs`` is not bound at all: ``bind_allowed``)."""
    rt = triton.knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _unbind(store: Dict[str, Any], exc: BaseException) -> None:
    """A bound launch (or its binding) failed: triton's own launch path from now on, for every plan."""
    global _BIND
    _BIND = False
    store.clear()
    declarations.fall_back(
        "a bound Triton launch (its compiled kernel called directly)", exc, "triton's own launch path", 4
    )


def _stream() -> int:
    from triton.runtime import driver

    active = driver.active
    return active.get_current_stream(active.get_current_device())


def launch_bound(store: Dict[str, Any], slot: str, step_key: Optional[tuple]) -> bool:
    """Launch ``store[slot]``'s bound kernel when it was bound with ``step_key`` (True), else nothing."""
    b = store.get(slot)
    if b is None or b.step_key != step_key or step_key is None or not _BIND or _hooks():
        return False
    g = b.grid
    try:
        b.run(g[0], g[1], g[2], _stream(), b.function, b.packed, None, None, None, *b.args)
    except Exception as exc:  # noqa: BLE001 - a refused call launched nothing: the caller takes triton's path
        _unbind(store, exc)
        return False
    return True


def launch(
    store: Dict[str, Any],
    slot: str,
    step_key: Optional[tuple],
    kernel: Any,
    grid: Tuple[int, ...],
    args: Sequence[Any],
    kwargs: Dict[str, Any],
) -> None:
    """``kernel[grid](*args, **kwargs)`` through triton's launch path, then bound in ``store[slot]`` for
    ``launch_bound`` (see the module docstring): its arguments in the kernel's parameter order, as
    triton's launcher takes them, tensors as their addresses. Nothing is bound without a ``step_key``,
    under the interpreter (whose launches return no compiled kernel), or with ``FEDOPT_TRITON_BIND=0``."""
    compiled = kernel[grid](*args, **kwargs)
    store.pop(slot, None)
    if step_key is None or not _BIND or compiled is None:
        return
    names = getattr(kernel, "arg_names", None)
    if names is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return
    given = len(args)
    try:
        values = [args[i] if i < given else kwargs[name] for i, name in enumerate(names)]
    except KeyError:  # a parameter with a default we did not pass: leave it to triton's path
        return
    try:
        bound = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values)
        store[slot] = Bound(compiled, tuple(grid), bound, step_key)
    except Exception as exc:  # noqa: BLE001 - a compiled kernel not as BIND_CHECKED's: triton's path
        _unbind(store, exc)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a step launches in: Triton launches on the *current* CUDA device (and its current
    stream), so tensors on another GPU make it current for the step. Entered only when the index
    differs (a host-side device switch, no sync); CPU tensors (the interpreter) need nothing."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()


def launch_options() -> dict:
    """Compile options of every launch. No FMA contraction: the math rounds as the reference's and the
    cuda backend's (``--fmad=false``), and every specialisation of a kernel (aligned or not, per
    client or client-batched) rounds alike, so a client's batched result is the per-client op's."""
    return {"num_warps": GPU_NUM_WARPS, "enable_fp_fusion": False}
