"""Op "padamfed" (PAdaMFed client step, SPEC §5): two passes, one launch per pass per dtype signature.

    v = beta * G + D                 (variance reduction: v = (G + D) - (1 - beta) * H)
    pass 1:  acc += G ; partial[slot] = sum of v*v over the program's tiles
    pass 2:  n = max(sqrt(sum of all partials), eps);  x -= v * (eta * (1 / n))

Pass 1 reads G, D, acc (+H) and writes acc; pass 2 reads G, D, x (+H) and writes x: 32 bytes per
float32 element (SPEC §7). ``1 - beta`` is formed on the host; ``eta / n`` is formed as torch forms
``scalar / tensor`` (reciprocal, then multiply); the clamp keeps a NaN norm NaN.
"""
from __future__ import annotations

from typing import Any, Dict

import triton
import triton.language as tl

from .jit_mode import device_fn
from .launcher import SLOT_BLOCK, Launch, Plan, num_warps
from .norm import global_norm, squares
from .tiles import chunk_of, load_f32, store_as, tile_of

ROLES = ("x", "g", "D", "acc", "H")
WRITTEN = ("x", "acc")
NR = tl.constexpr(len(ROLES) + 2)
_X, _G, _D, _ACC, _H = (tl.constexpr(i) for i in range(len(ROLES)))


@device_fn
def _direction(meta_ptr, t, start, col, mask, G, beta, one_minus_beta, D_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr,
               VR: tl.constexpr, ROWS: tl.constexpr):
    """v at ``start + col`` of tensor ``t`` given the float32 gradient G there."""
    D = load_f32(meta_ptr, t, start, col, mask, _D, NR, D_DTYPE, ROWS)
    if VR:
        v = G + D - one_minus_beta * load_f32(meta_ptr, t, start, col, mask, _H, NR, H_DTYPE, ROWS)
    else:
        v = beta * G + D
    return v


@device_fn
def _norm_tile(meta_ptr, t, start, col, mask, beta, one_minus_beta, G_DTYPE: tl.constexpr, D_DTYPE: tl.constexpr,
               ACC_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, VR: tl.constexpr, ROWS: tl.constexpr):
    """acc += G there; returns v*v (0 where masked off)."""
    G = load_f32(meta_ptr, t, start, col, mask, _G, NR, G_DTYPE, ROWS)
    acc = load_f32(meta_ptr, t, start, col, mask, _ACC, NR, ACC_DTYPE, ROWS)
    store_as(meta_ptr, t, start, col, mask, acc + G, _ACC, NR, ACC_DTYPE, ROWS)
    v = _direction(meta_ptr, t, start, col, mask, G, beta, one_minus_beta, D_DTYPE, H_DTYPE, VR, ROWS)
    return squares(v, mask)


@triton.jit(do_not_specialize=["n_chunks", "slot_base"])
def padamfed_norm_kernel(meta_ptr, chunks_ptr, n_chunks, partials_ptr, slot_base,
                         beta: tl.float32, one_minus_beta: tl.float32,
                         X_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, D_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr,
                         H_DTYPE: tl.constexpr, VR: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_chunks, ROWS)
    if ROWS == 1:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(pid, n_tiles, n_prog):  # fixed order: tiles pid, pid + P, ...
            t, start, n = chunk_of(chunks_ptr, meta_ptr, c, NR, BLOCK)
            col = tl.arange(0, BLOCK)
            if start + BLOCK <= n:
                acc += _norm_tile(meta_ptr, t, start, col, None, beta, one_minus_beta, G_DTYPE, D_DTYPE, ACC_DTYPE,
                                  H_DTYPE, VR, ROWS)
            else:
                acc += _norm_tile(meta_ptr, t, start, col, col < n - start, beta, one_minus_beta, G_DTYPE, D_DTYPE, ACC_DTYPE,
                                  H_DTYPE, VR, ROWS)
        tl.store(partials_ptr + slot_base + pid, tl.sum(acc, axis=0))
    else:
        acc2 = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for tile in range(pid, n_tiles, n_prog):
            t, start, col, mask = tile_of(chunks_ptr, meta_ptr, tile, n_chunks, NR, ROWS, BLOCK)
            acc2 += _norm_tile(meta_ptr, t, start, col, mask, beta, one_minus_beta, G_DTYPE, D_DTYPE, ACC_DTYPE,
                               H_DTYPE, VR, ROWS)
        tl.store(partials_ptr + slot_base + pid, tl.sum(tl.sum(acc2, axis=1), axis=0))


@device_fn
def _update_tile(meta_ptr, t, start, col, mask, scale, beta, one_minus_beta, X_DTYPE: tl.constexpr,
                 G_DTYPE: tl.constexpr, D_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, VR: tl.constexpr,
                 ROWS: tl.constexpr):
    G = load_f32(meta_ptr, t, start, col, mask, _G, NR, G_DTYPE, ROWS)
    v = _direction(meta_ptr, t, start, col, mask, G, beta, one_minus_beta, D_DTYPE, H_DTYPE, VR, ROWS)
    x = load_f32(meta_ptr, t, start, col, mask, _X, NR, X_DTYPE, ROWS)
    store_as(meta_ptr, t, start, col, mask, x - v * scale, _X, NR, X_DTYPE, ROWS)


@triton.jit(do_not_specialize=["n_chunks", "n_slots"])
def padamfed_update_kernel(meta_ptr, chunks_ptr, n_chunks, partials_ptr, n_slots,
                           lr: tl.float32, beta: tl.float32, one_minus_beta: tl.float32, eps: tl.float32,
                           X_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, D_DTYPE: tl.constexpr,
                           ACC_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, VR: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, SLOT_BLOCK: tl.constexpr):
    norm = global_norm(partials_ptr, n_slots, SLOT_BLOCK)
    norm = tl.where(norm < eps, eps, norm)  # max(norm, eps) that keeps NaN
    scale = tl.math.div_rn(1.0, norm) * lr
    pid = tl.program_id(0)
    if ROWS == 1:
        t, start, n = chunk_of(chunks_ptr, meta_ptr, pid, NR, BLOCK)
        col = tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            _update_tile(meta_ptr, t, start, col, None, scale, beta, one_minus_beta, X_DTYPE, G_DTYPE, D_DTYPE, H_DTYPE,
                         VR, ROWS)
        else:
            _update_tile(meta_ptr, t, start, col, col < n - start, scale, beta, one_minus_beta, X_DTYPE, G_DTYPE, D_DTYPE,
                         H_DTYPE, VR, ROWS)
    else:
        t, start, col, mask = tile_of(chunks_ptr, meta_ptr, pid, n_chunks, NR, ROWS, BLOCK)
        _update_tile(meta_ptr, t, start, col, mask, scale, beta, one_minus_beta, X_DTYPE, G_DTYPE, D_DTYPE,
                     H_DTYPE, VR, ROWS)


def _dtype_args(lau: Launch) -> Dict[str, Any]:
    dt = lau.dtypes
    return dict(X_DTYPE=dt["x"], G_DTYPE=dt["g"], D_DTYPE=dt["D"], ACC_DTYPE=dt["acc"], H_DTYPE=dt["H"],
                VR="H" in lau.present, ROWS=lau.rows, BLOCK=lau.block)


def launch_norm(lau: Launch, plan: Plan, hp: Dict[str, Any]) -> None:
    """Pass 1 over ``lau``: acc += G and the partial sums of v*v into its slots."""
    beta = float(hp["beta"])
    padamfed_norm_kernel[(lau.norm_programs,)](
        lau.meta, lau.chunks, lau.n_chunks, plan.partials, lau.slot_base, beta, 1.0 - beta,
        **_dtype_args(lau), num_warps=num_warps())


def launch_update(lau: Launch, plan: Plan, hp: Dict[str, Any]) -> None:
    """Pass 2 over ``lau``: x -= v * (eta / max(norm, eps)) with the global norm of all slots."""
    beta = float(hp["beta"])
    padamfed_update_kernel[(lau.n_tiles,)](
        lau.meta, lau.chunks, lau.n_chunks, plan.partials, plan.n_slots,
        float(hp["lr"]), beta, 1.0 - beta, float(hp["eps"]),
        **_dtype_args(lau), SLOT_BLOCK=SLOT_BLOCK, num_warps=num_warps())
