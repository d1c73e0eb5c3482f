"""The clipped sum of a chunk of clients' replies in Triton (``fedopt_kernels/core/clip_sum.py``).

Three launches per call, none reading anything back to the host:

1. per tensor, a program per (block of a row, client): the block's float64 sum of squares, into a
   fixed slot (``norm.squares``' arithmetic);
2. a program per client: its slots added in a fixed order (``norm.add_slots``), the norm, the
   factor ``min(1, C / norm)`` (0 when inactive) and the adaptive clip's bit;
3. per tensor, a program per block of the sums: the active clients' ``fl(f * x)`` added to the
   float64 sums in client order, without FMA contraction (``launch_options``), so with the same
   factors the sums are the reference's bit for bit.

``max_norm`` travels as a float64 tensor: a Python float argument is float32 in a compiled kernel.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .jit_mode import loop_bound
from .launcher import device_guard, launch_options
from .norm import add_slots, squares

BLOCK = 1024  # elements per program in passes 1 and 3
SLOT_BLOCK = 64  # slots added at once in pass 2


@triton.jit
def clip_squares_kernel(x_ptr, row_stride, numel, partial_ptr, per_client, first, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = tl.load(x_ptr + c * row_stride + offs, mask=mask, other=0.0)
    tl.store(partial_ptr + c * per_client + first + chunk, tl.sum(squares(v, mask), axis=0))


@triton.jit
def clip_factors_kernel(
    partial_ptr,
    per_client,
    max_norm_ptr,
    active_ptr,
    norms_ptr,
    factors_ptr,
    below_ptr,
    HAS_ACTIVE: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    lo = c * per_client
    acc = add_slots(tl.zeros([SLOT_BLOCK], dtype=tl.float64), partial_ptr, lo, lo + per_client, SLOT_BLOCK)
    norm = tl.sqrt(tl.sum(acc, axis=0))
    max_norm = tl.load(max_norm_ptr)
    f = max_norm / norm
    f = tl.where(f > 1.0, 1.0, f)  # norm 0: inf -> 1; NaN stays NaN (torch.clamp)
    below = norm <= max_norm
    if HAS_ACTIVE:
        on = tl.load(active_ptr + c) != 0
        f = tl.where(on, f, 0.0)
        below = below & on
    tl.store(norms_ptr + c, norm)
    tl.store(factors_ptr + c, f)
    tl.store(below_ptr + c, below)


@triton.jit
def clip_add_kernel(
    x_ptr, row_stride, numel, clients, factors_ptr, active_ptr, out_ptr, HAS_ACTIVE: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    s = tl.load(out_ptr + offs, mask=mask, other=0.0)
    row = x_ptr + offs  # client c's row: advanced by the stride (a 64-bit pointer, never an int32 product)
    for c in range(0, loop_bound(clients)):
        f = tl.load(factors_ptr + c)
        m = mask
        if HAS_ACTIVE:
            m = mask & (tl.load(active_ptr + c) != 0)  # an inactive row is never read (f is 0 there)
        x = tl.load(row, mask=m, other=0.0).to(tl.float64)
        s = s + f * x
        row += row_stride
    tl.store(out_ptr + offs, s, mask=mask)


def clip_sum(
    tensors: Sequence[torch.Tensor], max_norm: float, active: Optional[torch.Tensor], out: List[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(norms, factors, below)``, ``out`` added into (rows of ``tensors`` contiguous, ``out`` float64
    contiguous: ``clip_sum.clip_sum`` prepares them)."""
    x0 = tensors[0]
    C, device = x0.shape[0], x0.device
    f64 = torch.float64
    norms, factors = torch.empty(C, dtype=f64, device=device), torch.empty(C, dtype=f64, device=device)
    below = torch.empty(C, dtype=torch.bool, device=device)
    if C == 0:
        return norms, factors, below
    sizes = [t.numel() // C for t in tensors]
    chunks = [triton.cdiv(n, BLOCK) for n in sizes]
    per_client = sum(chunks)
    partial = torch.empty(max(C * per_client, 1), dtype=f64, device=device)
    bound = torch.full((1,), max_norm, dtype=f64, device=device)  # a fill on the device: no copy from the host
    act = active if active is not None else below  # never read without HAS_ACTIVE
    opts = launch_options()
    with device_guard(device):
        first = 0
        for t, n, k in zip(tensors, sizes, chunks, strict=True):
            if n:
                clip_squares_kernel[(k, C)](t, t.stride(0), n, partial, per_client, first, BLOCK=BLOCK, **opts)
            first += k
        clip_factors_kernel[(C,)](
            partial,
            per_client,
            bound,
            act,
            norms,
            factors,
            below,
            HAS_ACTIVE=active is not None,
            SLOT_BLOCK=SLOT_BLOCK,
            **opts,
        )
        for t, n, s in zip(tensors, sizes, out, strict=True):
            if n:
                grid = (triton.cdiv(n, BLOCK),)
                clip_add_kernel[grid](
                    t, t.stride(0), n, C, factors, act, s, HAS_ACTIVE=active is not None, BLOCK=BLOCK, **opts
                )
    return norms, factors, below
