"""Op "fedexp" (FedExP, docs/algorithms.md): the per-element math and the per-row-group factor; the two
passes that run them are ``two_pass_kernels.py``'s.

    g' = g * inv_scale
    pass 1:  squares of g' (float64)
    pass 2:  eta = max(1, mean_sq_norm / (2 (s^2 + eps)))  (float64);  x -= (lr * eta) * g'

``eta`` is formed in float64 from the float64 norm and rounded to float32 once, as the reference
forms it; a comparison keeps a NaN. Bytes per element (float32): 4 (pass 1: g) + 12 (pass 2: x, g,
write x).
"""

from __future__ import annotations

import triton.language as tl

from .declarations import spec_columns, spec_roles, spec_slots
from .jit_mode import device_fn
from .norm import squares
from .tiles import load_f32, store_as

# role slots and hp columns, from the op's declaration (fedopt_kernels/core/ops.py)
ROLES, WRITTEN = spec_roles("fedexp")
_X, _G = spec_slots("fedexp", "x", "g")
_LR, _EPS, _MSN, HPN = spec_columns("fedexp", "lr", "eps", "mean_sq_norm")


@device_fn
def factor(norm, r):
    """lr * max(1, mean_sq_norm / (2 (norm^2 + eps))) in float64, rounded to float32 (NaN kept)."""
    s = norm.to(tl.float64)
    q = tl.load(r + _MSN) / (2.0 * (s * s + tl.load(r + _EPS)))
    eta = tl.where(q < 1.0, 1.0, q)
    return (tl.load(r + _LR) * eta).to(tl.float32)


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
    """Pass 0: squares of g at ``at``; pass 1: x -= factor * g there. ``DT``: each role's element type,
    by slot (``two_pass_kernels._elem``); the op has no optional role."""
    X_DT, G_DT, _, _, _ = DT
    mask = at[4]
    g = load_f32(at, _G, G_DT, TILE)
    if UNSCALE:
        g = g * inv
    if PASS == 0:
        out = squares(g, mask)
    else:
        x = load_f32(at, _X, X_DT, TILE)
        store_as(at, x - factor * g, _X, X_DT, TILE)
        out = 0.0
    return out
