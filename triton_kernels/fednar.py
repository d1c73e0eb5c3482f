"""Op "fednar" (FedNAR, docs/algorithms.md): the per-element math and the per-batch factor; the two passes
that run them are ``two_pass.py``'s.

    d    = g * inv_scale (+ wd * x) (+ corr) (+ prox_mu * (x - x0))     recomputed in both passes
    pass 1:  squares of d (float64)
    pass 2:  coef = min(1, max_norm * (1 / (s + eps)));  x -= (step_lr * coef) * d

``coef`` is formed as the reference forms it (torch evaluates ``a / t`` as ``reciprocal(t) * a``)
and clamps with a comparison so a NaN norm stays NaN (clip_grad_norm_ semantics). Bytes per
element (float32): 8 (pass 1: x, g) + 12 (pass 2: x, g, write x), +8 each for corr and x0.
"""
from __future__ import annotations

import triton.language as tl

from .jit_mode import device_fn
from .launcher import spec_roles
from .norm import squares
from .tiles import hp_f32, load_f32, store_as

ROLES, WRITTEN = spec_roles("fednar")   # x, g, x0, corr
HPN = 5                                 # step_lr, weight_decay, max_norm, eps, prox_mu


@device_fn
def elem(meta_ptr, t, start, col, mask, r, inv, scale, PASS: tl.constexpr, NR: tl.constexpr,
         DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, DT4: tl.constexpr,
         P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, UNSCALE: tl.constexpr, ROWS: tl.constexpr,
         ALIGNED: tl.constexpr, VEC: tl.constexpr):
    """Pass 0: squares of d at ``start + col`` of tensor ``t``; pass 1: x -= scale * d there."""
    x = load_f32(meta_ptr, t, start, col, mask, 0, NR, DT0, ROWS, ALIGNED)
    d = load_f32(meta_ptr, t, start, col, mask, 1, NR, DT1, ROWS, ALIGNED)
    if UNSCALE:
        d = d * inv
    weight_decay = hp_f32(r, 1)
    # wd == 0 must leave d alone: 0 * inf would turn into NaN
    if VEC:  # batched 2-D tile: one weight decay per row
        d = tl.where(weight_decay != 0.0, d + weight_decay * x, d)
    else:
        if weight_decay != 0.0:
            d = d + weight_decay * x
    if P3:
        d = d + load_f32(meta_ptr, t, start, col, mask, 3, NR, DT3, ROWS, ALIGNED)
    if P2:
        d = d + hp_f32(r, 4) * (x - load_f32(meta_ptr, t, start, col, mask, 2, NR, DT2, ROWS, ALIGNED))
    if PASS == 0:
        out = squares(d, mask)
    else:
        store_as(meta_ptr, t, start, col, mask, x - scale * d, 0, NR, DT0, ROWS, ALIGNED)
        out = 0.0
    return out


@device_fn
def factor(norm, r):
    """step_lr * min(1, max_norm / (norm + eps)) in float32 from the float64 norm (NaN kept)."""
    s = norm.to(tl.float32)
    coef = tl.math.div_rn(1.0, s + hp_f32(r, 3)) * hp_f32(r, 2)
    coef = tl.where(coef > 1.0, 1.0, coef)  # min(coef, 1) that keeps NaN
    return hp_f32(r, 0) * coef
