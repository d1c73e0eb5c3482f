"""Op "padamfed" (PAdaMFed client step, docs/algorithms.md): the per-element math and the per-row-group factor;
the two passes that run them are ``two_pass_kernels.py``'s.

    G = g * inv_scale ;  v = beta * G + D       (variance reduction: v = (G + D) - (1 - beta) * H)
    pass 1:  acc += G ; squares of v (float64)
    pass 2:  n = max(norm, eps);  x -= v * (eta * (1 / n))

Pass 1 reads G, D, acc (+H) and writes acc; pass 2 reads G, D, x (+H) and writes x: 32 bytes per
float32 element. ``eta / n`` is formed as torch forms ``scalar / tensor`` (reciprocal,
then multiply); the clamp keeps a NaN norm NaN.
"""

from __future__ import annotations

import triton.language as tl

from .jit_mode import device_fn
from .launcher import spec_columns, spec_roles, spec_slots
from .norm import squares
from .tiles import hp_f32, load_f32, store_as

# role slots and hp columns, from the op's declaration (fedopt_kernels/core/ops.py)
ROLES, WRITTEN = spec_roles("padamfed")
_X, _G, _D, _ACC, _H = spec_slots("padamfed", "x", "g", "D", "acc", "H")
_LR, _BETA, _EPS, HPN = spec_columns("padamfed", "lr", "beta", "eps")


@device_fn
def factor(norm, r):
    """eta / max(norm, eps) in float32 from the float64 norm (NaN kept)."""
    n = norm.to(tl.float32)
    eps = hp_f32(r, _EPS)
    n = tl.where(n < eps, eps, n)  # max(norm, eps) that keeps NaN
    return tl.math.div_rn(1.0, n) * hp_f32(r, _LR)


@device_fn
def elem(
    meta_ptr,
    t,
    start,
    col,
    mask,
    r,
    inv,
    scale,
    PASS: tl.constexpr,
    NR: tl.constexpr,
    X_DT: tl.constexpr,
    G_DT: tl.constexpr,
    D_DT: tl.constexpr,
    ACC_DT: tl.constexpr,
    H_DT: tl.constexpr,
    HAS_H: tl.constexpr,
    UNSCALE: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """Pass 0: acc += G and the squares of v; pass 1: x -= v * scale."""
    G = load_f32(meta_ptr, t, start, col, mask, _G, NR, G_DT, ROWS, ALIGNED)
    if UNSCALE:
        G = G * inv
    D = load_f32(meta_ptr, t, start, col, mask, _D, NR, D_DT, ROWS, ALIGNED)
    if HAS_H:  # variance reduction
        one_minus_beta = (1.0 - tl.load(r + _BETA)).to(tl.float32)
        v = G + D - one_minus_beta * load_f32(meta_ptr, t, start, col, mask, _H, NR, H_DT, ROWS, ALIGNED)
    else:
        v = hp_f32(r, _BETA) * G + D
    if PASS == 0:
        acc = load_f32(meta_ptr, t, start, col, mask, _ACC, NR, ACC_DT, ROWS, ALIGNED)
        store_as(meta_ptr, t, start, col, mask, acc + G, _ACC, NR, ACC_DT, ROWS, ALIGNED)
        out = squares(v, mask)
    else:
        x = load_f32(meta_ptr, t, start, col, mask, _X, NR, X_DT, ROWS, ALIGNED)
        store_as(meta_ptr, t, start, col, mask, x - v * scale, _X, NR, X_DT, ROWS, ALIGNED)
        out = 0.0
    return out
