"""Op "sam_ascent" (FedSAM's ascent, docs/algorithms.md): the per-element math and the per-row-group factor;
the two passes that run them are ``two_pass_kernels.py``'s.

    g' = g * inv_scale ;  w = |x| + eta (adaptive) or 1 ;  d = w * g'
    pass 1:  squares of d (float64)
    pass 2:  saved = x ;  x += (rho * (1 / (s + eps))) * (w * d)

``adaptive`` is an hp value, so ``w`` is formed with a select and x is read in pass 1 even without
it (4 bytes per element more than the op's declared 20 there). ``rho / (s + eps)`` is formed as
torch forms ``scalar / tensor`` (reciprocal, then multiply).
"""

from __future__ import annotations

import triton.language as tl

from .declarations import spec_columns, spec_roles, spec_slots
from .jit_mode import device_fn
from .norm import squares
from .tiles import hp_f32, load_f32, store_as

# role slots and hp columns, from the op's declaration (fedopt_kernels/core/ops.py)
ROLES, WRITTEN = spec_roles("sam_ascent")
_X, _G, _SAVED = spec_slots("sam_ascent", "x", "g", "saved")
_RHO, _ETA, _EPS, _ADAPTIVE, HPN = spec_columns("sam_ascent", "rho", "eta", "eps", "adaptive")


@device_fn
def factor(norm, r):
    """rho / (norm + eps) in float32 from the float64 norm (NaN kept)."""
    s = norm.to(tl.float32)
    return tl.math.div_rn(1.0, s + hp_f32(r, _EPS)) * hp_f32(r, _RHO)


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
    """Pass 0: squares of d at ``at``; pass 1: saved = x, x += factor * (w * d). ``DT``: each role's
    element type, by slot; ``HAS``: whether the optional role saved is there (``two_pass_kernels._elem``)."""
    X_DT, G_DT, SAVED_DT, _, _ = DT
    HAS_SAVED, _, _ = HAS
    mask = at[4]
    x = load_f32(at, _X, X_DT, TILE)
    g = load_f32(at, _G, G_DT, TILE)
    if UNSCALE:
        g = g * inv
    adaptive = tl.load(r + _ADAPTIVE) != 0.0
    w = tl.where(adaptive, tl.abs(x) + hp_f32(r, _ETA), 1.0)
    d = tl.where(adaptive, w * g, g)
    if PASS == 0:
        out = squares(d, mask)
    else:
        if HAS_SAVED:  # the optimizer always gives it; a bare op call may not
            store_as(at, x, _SAVED, SAVED_DT, TILE)
        store_as(at, x + factor * tl.where(adaptive, w * d, g), _X, X_DT, TILE)
        out = 0.0
    return out
