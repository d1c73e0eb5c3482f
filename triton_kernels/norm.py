"""Device-side pieces of the deterministic two-pass global L2 norm.

Pass 1 (a norm kernel of each op) writes one float32 partial sum of squares per program into a
fixed slot. Pass 2 (the update kernel) calls ``global_norm``: every program reduces all slots in
the same fixed order, so the norm is bitwise reproducible and never leaves the device.
"""
import triton
import triton.language as tl

from .jit_mode import device_fn


@device_fn
def sum_slots(partials_ptr, n_slots, SLOT_BLOCK: tl.constexpr):
    """Sum of ``partials[0:n_slots]`` in a fixed order (blocks of SLOT_BLOCK, then a fixed tree)."""
    acc = tl.zeros([SLOT_BLOCK], dtype=tl.float32)
    for s0 in range(0, n_slots, SLOT_BLOCK):
        idx = s0 + tl.arange(0, SLOT_BLOCK)
        acc += tl.load(partials_ptr + idx, mask=idx < n_slots, other=0.0)
    return tl.sum(acc, axis=0)


@device_fn
def global_norm(partials_ptr, n_slots, SLOT_BLOCK: tl.constexpr):
    """sqrt of the summed partials, IEEE-rounded (inf/NaN propagate as in clip_grad_norm_)."""
    return tl.sqrt_rn(sum_slots(partials_ptr, n_slots, SLOT_BLOCK))


@device_fn
def squares(v, mask):
    """v*v, with masked-off lanes contributing exactly 0."""
    if mask is None:
        sq = v * v
    else:
        sq = tl.where(mask, v * v, 0.0)
    return sq
