"""Op "fednar" (FedNAR, docs/algorithms.md): the per-element math and the per-row-group factor; the two passes
that run them are ``two_pass_kernels.py``'s.

    d    = g * inv_scale (+ wd * x) (+ corr) (+ prox_mu * (x - x0))     recomputed in both passes
    pass 1:  squares of d (float64)
    pass 2:  coef = min(1, max_norm * (1 / (s + eps)));  x -= (lr * coef) * d

``coef`` is formed as the reference forms it (torch evaluates ``a / t`` as ``reciprocal(t) * a``)
and clamps with a comparison so a NaN norm stays NaN (clip_grad_norm_ semantics). Bytes per
element (float32): 8 (pass 1: x, g) + 12 (pass 2: x, g, write x), +8 each for corr and x0.
"""

from __future__ import annotations

import triton.language as tl

from .declarations import spec_columns, spec_roles, spec_slots
from .jit_mode import device_fn
from .norm import squares
from .tiles import add_terms, hp_f32, load_f32, store_as

# role slots and hp columns, from the op's declaration (fedopt_kernels/core/ops.py)
ROLES, WRITTEN = spec_roles("fednar")
_X, _G, _X0, _CORR = spec_slots("fednar", "x", "g", "x0", "corr")
_LR, _WD, _MAX_NORM, _EPS, _PROX, HPN = spec_columns("fednar", "lr", "weight_decay", "max_norm", "eps", "prox_mu")


@device_fn
def factor(norm, r):
    """lr * min(1, max_norm / (norm + eps)) in float32 from the float64 norm (NaN kept)."""
    s = norm.to(tl.float32)
    coef = tl.math.div_rn(1.0, s + hp_f32(r, _EPS)) * hp_f32(r, _MAX_NORM)
    coef = tl.where(coef > 1.0, 1.0, coef)  # min(coef, 1) that keeps NaN
    return hp_f32(r, _LR) * coef


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
    """Pass 0: squares of d at ``at``; pass 1: x -= factor * d there. ``DT``: each role's element type,
    by slot; ``HAS``: whether optional roles x0 and corr are there (``two_pass_kernels._elem``)."""
    X_DT, G_DT, X0_DT, CORR_DT, _ = DT
    HAS_X0, HAS_CORR, _ = HAS
    mask = at[4]
    x = load_f32(at, _X, X_DT, TILE)
    d = load_f32(at, _G, G_DT, TILE)
    if UNSCALE:
        d = d * inv
    d = add_terms(d, x, hp_f32(r, _WD), hp_f32(r, _PROX), at, _CORR, CORR_DT, HAS_CORR, _X0, X0_DT, HAS_X0, TILE, VEC)
    if PASS == 0:
        out = squares(d, mask)
    else:
        store_as(at, x - factor * d, _X, X_DT, TILE)
        out = 0.0
    return out
