"""Device-side pieces of the deterministic two-pass global L2 norm.

Pass 1 (the norm kernel) writes one float64 partial sum of squares per program into a fixed slot:
float64, because squares of float32 values overflow float32 above ~1.8e19 and underflow below
~1e-23 (the norm must be right for every element in [1e-30, 1e30]). Pass 2 (the update
kernel) calls ``global_norm``: every program reduces all slots in the same fixed order, so the
norm is bitwise reproducible and never leaves the device.
"""

import triton.language as tl

from .jit_mode import device_fn, loop_bound


@device_fn
def add_slots(acc, partials_ptr, lo, hi, SLOT_BLOCK: tl.constexpr):
    """``acc`` (float64 [SLOT_BLOCK]) plus ``partials[lo:hi]``, lane ``i`` taking slots ``lo + i``,
    ``lo + i + SLOT_BLOCK``, ...: a fixed order."""
    for s0 in range(loop_bound(lo), loop_bound(hi), SLOT_BLOCK):
        idx = s0 + tl.arange(0, SLOT_BLOCK)
        acc += tl.load(partials_ptr + idx, mask=idx < hi, other=0.0)
    return acc


@device_fn
def sum_slots(partials_ptr, n_slots, SLOT_BLOCK: tl.constexpr):
    """Sum of ``partials[0:n_slots]`` in a fixed order (blocks of SLOT_BLOCK, then a fixed tree)."""
    acc = add_slots(tl.zeros([SLOT_BLOCK], dtype=tl.float64), partials_ptr, 0, n_slots, SLOT_BLOCK)
    return tl.sum(acc, axis=0)


@device_fn
def global_norm(partials_ptr, n_slots, SLOT_BLOCK: tl.constexpr):
    """sqrt of the summed partials in float64 (a float64 sqrt is IEEE-rounded; inf/NaN propagate as in
    clip_grad_norm_)."""
    return tl.sqrt(sum_slots(partials_ptr, n_slots, SLOT_BLOCK))


@device_fn
def squares(v, mask):
    """v*v in float64, with masked-off lanes contributing exactly 0."""
    w = v.to(tl.float64)
    if mask is None:
        sq = w * w
    else:
        sq = tl.where(mask, w * w, 0.0)
    return sq
