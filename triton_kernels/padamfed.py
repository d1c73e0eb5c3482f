"""Op "padamfed" (PAdaMFed client step, docs/algorithms.md): the per-element math and the per-batch factor;
the two passes that run them are ``two_pass.py``'s.

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
from .launcher import spec_roles
from .norm import squares
from .tiles import hp_f32, load_f32, store_as

ROLES, WRITTEN = spec_roles("padamfed")   # x, g, D, acc, H
HPN = 3                                   # lr, beta, eps


@device_fn
def elem(meta_ptr, t, start, col, mask, r, inv, scale, PASS: tl.constexpr, NR: tl.constexpr,
         DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, DT4: tl.constexpr,
         P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, UNSCALE: tl.constexpr, ROWS: tl.constexpr,
         ALIGNED: tl.constexpr, VEC: tl.constexpr):
    """Pass 0: acc += G and the squares of v; pass 1: x -= v * scale."""
    G = load_f32(meta_ptr, t, start, col, mask, 1, NR, DT1, ROWS, ALIGNED)
    if UNSCALE:
        G = G * inv
    D = load_f32(meta_ptr, t, start, col, mask, 2, NR, DT2, ROWS, ALIGNED)
    if P4:
        one_minus_beta = (1.0 - tl.load(r + 1)).to(tl.float32)
        v = G + D - one_minus_beta * load_f32(meta_ptr, t, start, col, mask, 4, NR, DT4, ROWS, ALIGNED)
    else:
        v = hp_f32(r, 1) * G + D
    if PASS == 0:
        acc = load_f32(meta_ptr, t, start, col, mask, 3, NR, DT3, ROWS, ALIGNED)
        store_as(meta_ptr, t, start, col, mask, acc + G, 3, NR, DT3, ROWS, ALIGNED)
        out = squares(v, mask)
    else:
        x = load_f32(meta_ptr, t, start, col, mask, 0, NR, DT0, ROWS, ALIGNED)
        store_as(meta_ptr, t, start, col, mask, x - v * scale, 0, NR, DT0, ROWS, ALIGNED)
        out = 0.0
    return out


@device_fn
def factor(norm, r):
    """eta / max(norm, eps) in float32 from the float64 norm (NaN kept)."""
    n = norm.to(tl.float32)
    eps = hp_f32(r, 2)
    n = tl.where(n < eps, eps, n)  # max(norm, eps) that keeps NaN
    return tl.math.div_rn(1.0, n) * hp_f32(r, 0)
