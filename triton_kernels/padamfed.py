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

from .declarations import spec_columns, spec_roles, spec_slots
from .jit_mode import device_fn
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
    at,
    r,
    inv,
    factor,
    PASS: tl.constexpr,
    DT: tl.constexpr,
    HAS: tl.constexpr,
    UNSCALE: tl.constexpr,
    TILE: tl.constexpr,
    VEC: tl.constexpr,
):
    """Pass 0: acc += G and the squares of v; pass 1: x -= v * factor. ``DT``: each role's element
    type, by slot; ``HAS``: whether the optional role H is there (``two_pass_kernels._elem``)."""
    X_DT, G_DT, D_DT, ACC_DT, H_DT = DT
    _, _, HAS_H = HAS
    mask = at[4]
    G = load_f32(at, _G, G_DT, TILE)
    if UNSCALE:
        G = G * inv
    D = load_f32(at, _D, D_DT, TILE)
    if HAS_H:  # variance reduction
        one_minus_beta = (1.0 - tl.load(r + _BETA)).to(tl.float32)
        v = G + D - one_minus_beta * load_f32(at, _H, H_DT, TILE)
    else:
        v = hp_f32(r, _BETA) * G + D
    if PASS == 0:
        acc = load_f32(at, _ACC, ACC_DT, TILE)
        store_as(at, acc + G, _ACC, ACC_DT, TILE)
        out = squares(v, mask)
    else:
        x = load_f32(at, _X, X_DT, TILE)
        store_as(at, x - v * factor, _X, X_DT, TILE)
        out = 0.0
    return out
