"""A chunk of clients' replies clipped to a global L2 norm and summed: one multi-tensor op per backend.

For ``tensors`` ``[C, *shape_j]`` (row ``c`` of every tensor is client ``c``'s reply, the whole reply
one vector), ``clip_sum`` computes

    norms[c]   = sqrt(sum_j ||tensors[j][c]||^2)       squares summed in float64
    factors[c] = min(1, max_norm / norms[c])           0 for an inactive client
    below[c]   = active[c] and norms[c] <= max_norm    adaptive clipping's bit
    out[j]    += sum_c factors[c] * tensors[j][c]      float64, clients added in order 0..C-1

which is DP-FedAvg's clip and sum for a chunk of the client-batched engine ("Learning Differentially
Private Recurrent Language Models", McMahan, Ramage, Talwar, Zhang; ICLR 2018, Algorithm 1's
``ClipFn``), with adaptive clipping's count ("Differentially Private Learning with Adaptive
Clipping", Andrew, Thakkar, McMahan, Ramaswamy; NeurIPS 2021). An inactive client's rows are never
added (they may hold NaN or inf). Nothing is read back to the host.

Backends (``backend``), as for the optimizer ops (``registry.auto_backend``):

* ``reference``: PyTorch (``clip_sum_reference.py``), the statement the others are tested against;
* ``cpu``: C++ of ``_C_cpu`` (csrc/cpu/clip_sum_cpu.cpp): the norms from fixed chunks' float64
  partials added in a fixed order, and the sums over element blocks, so the bits do not depend on
  the number of threads;
* ``cuda``: ``_C_cuda`` (csrc/cuda/clip_sum.cu); ``triton``: ``triton_kernels/clip_sum.py``. Both
  reduce in a fixed order too. A failure of either (a driver, a compiler) is recorded and warned
  about once (``fallbacks``), and the reference runs instead, for the rest of the process.

``torch.ops.fedopt.clip_sum`` is the same op declared with ``torch.library`` (its sums given).

The sums round every term once and add it (no fused multiply-add) on every backend, so with the
same factors every backend's sums are the reference's bit for bit; the norms differ by the order
of their float64 additions only.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from . import fallbacks
from .clip_sum_reference import clip_sum_reference
from .registry import BACKENDS, unavailable_reason

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DROPPED: Set[str] = set()  # backends whose kernel failed in this process (the reference ran instead)


class ClipSum(NamedTuple):
    """``clip_sum``'s result: float64 ``norms`` and ``factors`` [C], bool ``below`` [C], the sums."""

    norms: torch.Tensor
    factors: torch.Tensor
    below: torch.Tensor
    sums: List[torch.Tensor]


def check(
    tensors: Sequence[torch.Tensor],
    max_norm: float,
    active: Optional[torch.Tensor],
    out: Optional[Sequence[torch.Tensor]],
) -> None:
    """ValueError naming the first argument that ``clip_sum`` cannot take (nothing is changed)."""
    if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0):
        raise ValueError(f"max_norm (dp_clip) must be a number > 0, got {max_norm!r}")
    if not isinstance(tensors, (list, tuple)) or len(tensors) == 0:
        raise ValueError("tensors is empty: a chunk's reply has at least one tensor [C, *shape]")
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"tensors must be tensors, got {[type(t).__name__ for t in tensors]}")
    C, device = (tensors[0].shape[0] if tensors[0].dim() else None), tensors[0].device
    if any(t.dim() < 1 or t.shape[0] != C for t in tensors):
        raise ValueError(f"tensors must each be [C, *shape] with one C; got {[tuple(t.shape) for t in tensors]}")
    if any(t.dtype not in DTYPES for t in tensors):
        raise ValueError(f"tensors must be float16, bfloat16, float32 or float64; got {[t.dtype for t in tensors]}")
    if any(t.device != device for t in tensors):
        raise ValueError(f"tensors must be on one device; got {sorted({str(t.device) for t in tensors})}")
    if active is not None and (
        not isinstance(active, torch.Tensor)
        or active.dtype != torch.bool
        or tuple(active.shape) != (C,)
        or active.device != device
    ):
        got = f"{active.dtype} {tuple(active.shape)} on {active.device}" if isinstance(active, torch.Tensor) else active
        raise ValueError(f"active must be a bool tensor of shape ({C},) on {device}, got {got}")
    if out is not None:
        if len(out) != len(tensors):
            raise ValueError(f"out has {len(out)} tensors for {len(tensors)} tensors")
        for j, (o, t) in enumerate(zip(out, tensors, strict=True)):
            want = sum_dtype(device)
            if not isinstance(o, torch.Tensor) or o.dtype != want or o.shape != t.shape[1:] or o.device != device:
                got = f"{o.dtype} {tuple(o.shape)} on {o.device}" if isinstance(o, torch.Tensor) else o
                raise ValueError(f"out[{j}] must be {want} {tuple(t.shape[1:])} on {device}, got {got}")


def sum_dtype(device: torch.device) -> torch.dtype:
    """The sums' dtype: float64, except on a device without it (Apple's MPS: float32)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each client's row contiguous in memory (any distance between rows); a copy otherwise."""
    if t.shape[0] == 0 or t[0].is_contiguous():
        return t
    return t.contiguous()


def _compiled(backend: str) -> Callable:
    """The kernel of a compiled or Triton backend (ImportError / AttributeError when it has none)."""
    if backend == "triton":
        return importlib.import_module("fedopt_kernels.triton_kernels.clip_sum").clip_sum
    module = importlib.import_module(f"fedopt_kernels.core.backends.{backend}")
    return module.extension.clip_sum  # an extension built before this op has none: the caller falls back


def choose(device: torch.device, backend: str = "auto") -> str:
    """The backend that runs ``clip_sum`` on ``device``: ``backend`` when usable (ValueError naming it
    when not), or for ``"auto"`` cuda, else triton on CUDA tensors and cpu on CPU tensors, where they
    load here and have the kernel, else the reference."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
        why = unavailable_reason(backend, device)
        if why is not None:
            raise ValueError(f"backend={backend!r} cannot run clip_sum: {why}")
        return backend
    order = ("cuda", "triton") if device.type == "cuda" else ("cpu",) if device.type == "cpu" else ()
    for name in order:
        if name not in _DROPPED and unavailable_reason(name, device) is None:
            try:
                _compiled(name)
            except (ImportError, AttributeError):
                continue  # built before this op: the next one, or the reference
            return name
    return "reference"


def clip_sum(
    tensors: Sequence[torch.Tensor],
    max_norm: float,
    active: Optional[torch.Tensor] = None,
    out: Optional[Sequence[torch.Tensor]] = None,
    backend: str = "auto",
) -> ClipSum:
    """Clip a chunk of clients' replies and add them up (module docstring): ``(norms, factors, below,
    sums)``. ``tensors``: ``[C, *shape]`` each, float16/bfloat16/float32/float64, views read as they
    are; ``active``: bool ``[C]`` (None: all); ``out``: float64 sums to add into (None: zeros);
    ``backend``: ``"auto"`` or a name of ``registry.BACKENDS``. ValueError naming a bad argument,
    before anything is computed."""
    check(tensors, max_norm, active, out)
    device = tensors[0].device
    name = choose(device, backend)
    sums = (
        [torch.zeros(t.shape[1:], dtype=sum_dtype(device), device=device) for t in tensors]
        if out is None
        else list(out)
    )
    if name == "reference":
        return ClipSum(*clip_sum_reference(tensors, float(max_norm), active, sums), sums)
    try:
        kernel = _compiled(name)
    except (ImportError, AttributeError) as exc:  # only an explicit backend gets here (choose)
        raise ValueError(f"backend={backend!r} has no clip_sum kernel in this build ({exc})") from None
    dense = [s if s.is_contiguous() else s.contiguous() for s in sums]
    gpu = name in ("cuda", "triton")
    # a GPU kernel may fail part way (a compiler, a driver): the sums as they were, for the reference
    before = [s.clone() for s in sums] if gpu and out is not None else None
    try:
        norms, factors, below = kernel([_rows(t) for t in tensors], float(max_norm), active, dense)
    except RuntimeError as exc:
        if not gpu:
            raise
        _DROPPED.add(name)  # dropped for the process, said once
        fallbacks.fall_back(f"the {name} clip_sum kernel", exc, "the reference clip_sum runs")
        for j, s in enumerate(sums):
            if before is None:
                s.zero_()
            else:
                s.copy_(before[j])
        return ClipSum(*clip_sum_reference(tensors, float(max_norm), active, sums), sums)
    for s, d in zip(sums, dense, strict=True):
        if s is not d:
            s.copy_(d)
    return ClipSum(norms, factors, below, sums)


def backends_with_kernel(device: torch.device) -> Dict[str, Optional[str]]:
    """Each backend name -> None when it runs ``clip_sum`` on ``device``, else why not (for tests and
    reports)."""
    out: Dict[str, Optional[str]] = {}
    for name in BACKENDS:
        why = unavailable_reason(name, device)
        if why is None and name != "reference":
            try:
                _compiled(name)
            except (ImportError, AttributeError) as exc:
                why = f"backend {name!r} has no clip_sum kernel in this build ({exc})"
        out[name] = why
    return out


# ------------------------------------------------------------------------------- torch.library
@torch.library.custom_op("fedopt::clip_sum", mutates_args=("out",))
def _clip_sum_op(
    tensors: List[torch.Tensor], max_norm: float, active: Optional[torch.Tensor], out: List[torch.Tensor], backend: str
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.fedopt.clip_sum(tensors, max_norm, active, out, backend) -> (norms, factors, below)``:
    ``clip_sum`` as a PyTorch operator (one opaque node under ``torch.compile``), ``out`` added into."""
    norms, factors, below, _ = clip_sum(tensors, max_norm, active, out, backend)
    return norms, factors, below


@_clip_sum_op.register_fake
def _clip_sum_shapes(tensors, max_norm, active, out, backend):
    C, device = tensors[0].shape[0], tensors[0].device
    f64 = torch.empty(C, dtype=torch.float64, device=device)
    return f64, torch.empty_like(f64), torch.empty(C, dtype=torch.bool, device=device)
