"""Op "fednar" (FedNAR, SPEC §4): two passes, one launch per pass per dtype signature.

    d    = g (+ wd * x) (+ corr) (+ prox_mu * (x - x0))          recomputed in both passes
    pass 1:  partial[slot] = sum of d*d over the program's tiles
    pass 2:  s = sqrt(sum of all partials); coef = min(1, max_norm * (1 / (s + eps)));
             x -= (step_lr * coef) * d

``coef`` is formed as the reference forms it (torch evaluates ``a / t`` as ``reciprocal(t) * a``)
and clamps with a comparison so a NaN norm stays NaN (clip_grad_norm_ semantics). Bytes per
element (float32): 8 (pass 1: x, g) + 12 (pass 2: x, g, write x), +8 each for corr and x0.
"""
from __future__ import annotations

from typing import Any, Dict

import triton
import triton.language as tl

from .jit_mode import device_fn
from .launcher import SLOT_BLOCK, Launch, Plan, num_warps
from .norm import global_norm, squares
from .tiles import chunk_of, load_f32, store_as, tile_of

ROLES = ("x", "g", "x0", "corr")
WRITTEN = ("x",)
NR = tl.constexpr(len(ROLES) + 2)
_X, _G, _X0, _CORR = (tl.constexpr(i) for i in range(len(ROLES)))


@device_fn
def _direction(meta_ptr, t, start, col, mask, weight_decay, prox_mu, X_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
               X0_DTYPE: tl.constexpr, CORR_DTYPE: tl.constexpr, HAS_X0: tl.constexpr, HAS_CORR: tl.constexpr,
               ROWS: tl.constexpr):
    """(x, d) at ``start + col`` of tensor ``t``, float32."""
    x = load_f32(meta_ptr, t, start, col, mask, _X, NR, X_DTYPE, ROWS)
    d = load_f32(meta_ptr, t, start, col, mask, _G, NR, G_DTYPE, ROWS)
    if weight_decay != 0.0:  # runtime branch: 0 * inf must not turn into NaN when wd == 0
        d = d + weight_decay * x
    if HAS_CORR:
        d = d + load_f32(meta_ptr, t, start, col, mask, _CORR, NR, CORR_DTYPE, ROWS)
    if HAS_X0:
        d = d + prox_mu * (x - load_f32(meta_ptr, t, start, col, mask, _X0, NR, X0_DTYPE, ROWS))
    return x, d


@triton.jit(do_not_specialize=["n_chunks", "slot_base"])
def fednar_norm_kernel(meta_ptr, chunks_ptr, n_chunks, partials_ptr, slot_base,
                       weight_decay: tl.float32, prox_mu: tl.float32,
                       X_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, X0_DTYPE: tl.constexpr, CORR_DTYPE: tl.constexpr,
                       HAS_X0: tl.constexpr, HAS_CORR: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_chunks, ROWS)
    if ROWS == 1:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(pid, n_tiles, n_prog):  # fixed order: tiles pid, pid + P, ...
            t, start, n = chunk_of(chunks_ptr, meta_ptr, c, NR, BLOCK)
            col = tl.arange(0, BLOCK)
            if start + BLOCK <= n:
                _x, d = _direction(meta_ptr, t, start, col, None, weight_decay, prox_mu, X_DTYPE, G_DTYPE, X0_DTYPE,
                                   CORR_DTYPE, HAS_X0, HAS_CORR, ROWS)
                acc += squares(d, None)
            else:
                mask = col < n - start
                _x, d = _direction(meta_ptr, t, start, col, mask, weight_decay, prox_mu, X_DTYPE, G_DTYPE, X0_DTYPE,
                                   CORR_DTYPE, HAS_X0, HAS_CORR, ROWS)
                acc += squares(d, mask)
        tl.store(partials_ptr + slot_base + pid, tl.sum(acc, axis=0))
    else:
        acc2 = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for tile in range(pid, n_tiles, n_prog):
            t, start, col, mask = tile_of(chunks_ptr, meta_ptr, tile, n_chunks, NR, ROWS, BLOCK)
            _x, d = _direction(meta_ptr, t, start, col, mask, weight_decay, prox_mu, X_DTYPE, G_DTYPE, X0_DTYPE,
                               CORR_DTYPE, HAS_X0, HAS_CORR, ROWS)
            acc2 += squares(d, mask)
        tl.store(partials_ptr + slot_base + pid, tl.sum(tl.sum(acc2, axis=1), axis=0))


@device_fn
def _update_tile(meta_ptr, t, start, col, mask, scale, weight_decay, prox_mu, X_DTYPE: tl.constexpr,
                 G_DTYPE: tl.constexpr, X0_DTYPE: tl.constexpr, CORR_DTYPE: tl.constexpr, HAS_X0: tl.constexpr,
                 HAS_CORR: tl.constexpr, ROWS: tl.constexpr):
    x, d = _direction(meta_ptr, t, start, col, mask, weight_decay, prox_mu, X_DTYPE, G_DTYPE, X0_DTYPE, CORR_DTYPE,
                      HAS_X0, HAS_CORR, ROWS)
    store_as(meta_ptr, t, start, col, mask, x - scale * d, _X, NR, X_DTYPE, ROWS)


@triton.jit(do_not_specialize=["n_chunks", "n_slots"])
def fednar_update_kernel(meta_ptr, chunks_ptr, n_chunks, partials_ptr, n_slots,
                         step_lr: tl.float32, weight_decay: tl.float32, max_norm: tl.float32, eps: tl.float32,
                         prox_mu: tl.float32,
                         X_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, X0_DTYPE: tl.constexpr,
                         CORR_DTYPE: tl.constexpr, HAS_X0: tl.constexpr, HAS_CORR: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, SLOT_BLOCK: tl.constexpr):
    s = global_norm(partials_ptr, n_slots, SLOT_BLOCK)
    coef = tl.math.div_rn(1.0, s + eps) * max_norm
    coef = tl.where(coef > 1.0, 1.0, coef)  # min(coef, 1) that keeps NaN
    scale = step_lr * coef
    pid = tl.program_id(0)
    if ROWS == 1:
        t, start, n = chunk_of(chunks_ptr, meta_ptr, pid, NR, BLOCK)
        col = tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            _update_tile(meta_ptr, t, start, col, None, scale, weight_decay, prox_mu, X_DTYPE, G_DTYPE, X0_DTYPE,
                         CORR_DTYPE, HAS_X0, HAS_CORR, ROWS)
        else:
            _update_tile(meta_ptr, t, start, col, col < n - start, scale, weight_decay, prox_mu, X_DTYPE, G_DTYPE, X0_DTYPE,
                         CORR_DTYPE, HAS_X0, HAS_CORR, ROWS)
    else:
        t, start, col, mask = tile_of(chunks_ptr, meta_ptr, pid, n_chunks, NR, ROWS, BLOCK)
        _update_tile(meta_ptr, t, start, col, mask, scale, weight_decay, prox_mu, X_DTYPE, G_DTYPE, X0_DTYPE,
                     CORR_DTYPE, HAS_X0, HAS_CORR, ROWS)


def _dtype_args(lau: Launch) -> Dict[str, Any]:
    dt = lau.dtypes
    return dict(X_DTYPE=dt["x"], G_DTYPE=dt["g"], X0_DTYPE=dt["x0"], CORR_DTYPE=dt["corr"],
                HAS_X0="x0" in lau.present, HAS_CORR="corr" in lau.present, ROWS=lau.rows, BLOCK=lau.block)


def launch_norm(lau: Launch, plan: Plan, hp: Dict[str, Any]) -> None:
    """Pass 1 over ``lau``: its partial sums of d*d into its slots of ``plan.partials``."""
    fednar_norm_kernel[(lau.norm_programs,)](
        lau.meta, lau.chunks, lau.n_chunks, plan.partials, lau.slot_base,
        float(hp["weight_decay"]), float(hp.get("prox_mu", 0.0)), **_dtype_args(lau), num_warps=num_warps())


def launch_update(lau: Launch, plan: Plan, hp: Dict[str, Any]) -> None:
    """Pass 2 over ``lau``: x -= step_lr * coef * d with the global norm of all slots."""
    fednar_update_kernel[(lau.n_tiles,)](
        lau.meta, lau.chunks, lau.n_chunks, plan.partials, plan.n_slots,
        float(hp["step_lr"]), float(hp["weight_decay"]), float(hp["max_norm"]), float(hp["eps"]),
        float(hp.get("prox_mu", 0.0)), **_dtype_args(lau), SLOT_BLOCK=SLOT_BLOCK, num_warps=num_warps())
