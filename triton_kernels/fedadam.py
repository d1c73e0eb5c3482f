"""Op "fedadam" (FedAdam, FedYogi, FedAdagrad; Reddi et al., Algorithm 2): one pass, one launch per
row group and dtype signature.

Per element, in float32 (``fedopt_kernels/core/reference.py``'s ``fedadam_step`` is the contract, same order)::

    t    = k + 1 ;  c1 = 1 / (1 - beta1^t), c2 = 1 / sqrt(1 - beta2^t)  (float64; 1 without bias
                                                                        correction, c2 = 1 for Adagrad)
    g    = g * inv_scale (GradScaler)
    m    = beta1 * m + (1 - beta1) * g
    v    = beta2 * v + (1 - beta2) * g^2  (rule 0, Adam)  |  v - (1 - beta2) * g^2 * sign(v - g^2)
           (rule 1, Yogi)  |  v + g^2  (rule 2, Adagrad)
    x   -= (lr * c1) * (m / (sqrt(v) * c2 + tau))

The rule is an hp value (a select, not a constexpr), so the three optimizers share compiled kernels.
The same kernel runs ``fedadam_batched``: each tensor of the table is one client's slice, with its
own hp row and counter.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import triton
import triton.language as tl

from .declarations import spec_columns, spec_roles, spec_slots
from .jit_mode import device_fn
from .launcher import launch as run_launch
from .launcher import launch_bound, launch_options
from .plans import Launch
from .tiles import chunk_of, client_active, inv_scale, live_step, load_f32, row_client, store_as, tile_rows

# role slots and hp columns, from the op's declaration (fedopt_kernels/core/ops.py)
ROLES, WRITTEN = spec_roles("fedadam")
_X, _G, _M, _V = spec_slots("fedadam", "x", "g", "m", "v")
_LR, _B1, _B2, _TAU, _RULE, _BC, HPN = spec_columns("fedadam", "lr", "beta1", "beta2", "tau", "rule", "bias_correction")


@device_fn
def _power(b, t):
    """b ** t for float64 b in [0, 1) and t >= 1 (0 ** t = 0)."""
    return tl.where(b == 0.0, 0.0, tl.exp(t * tl.log(tl.where(b == 0.0, 1.0, b))))


@device_fn
def _adam_hp(hp_ptr, hp_row, k_ptr, client):
    """The float32 factors of hp row ``hp_row`` at the client's step t = k + 1 (scalars, or [ROWS, 1])."""
    r = hp_ptr + hp_row * HPN
    t = (tl.load(k_ptr + client) + 1).to(tl.float64)
    b1 = tl.load(r + _B1)
    b2 = tl.load(r + _B2)
    rule = tl.load(r + _RULE).to(tl.int32)  # truncated, as the reference and the C++ kernels read it
    bc = tl.load(r + _BC) != 0.0
    c1 = tl.where(bc, 1.0 / (1.0 - _power(b1, t)), 1.0)
    c2 = tl.where(bc & (rule != 2), 1.0 / tl.sqrt(1.0 - _power(b2, t)), 1.0)
    step = (tl.load(r + _LR) * c1).to(tl.float32)
    return (
        step,
        b1.to(tl.float32),
        (1.0 - b1).to(tl.float32),
        b2.to(tl.float32),
        (1.0 - b2).to(tl.float32),
        tl.load(r + _TAU).to(tl.float32),
        c2.to(tl.float32),
        rule,
    )


@device_fn
def _adam_tile(at, hp, inv, DT: tl.constexpr, UNSCALE: tl.constexpr, TILE: tl.constexpr):
    """The update at ``at`` (``tiles.py``'s bundles); ``hp``: ``_adam_hp``'s factors; ``DT``: the
    element types of x, g, m, v."""
    step, b1, omb1, b2, omb2, tau, c2, rule = hp
    X_DTYPE, G_DTYPE, M_DTYPE, V_DTYPE = DT
    x = load_f32(at, _X, X_DTYPE, TILE)
    g = load_f32(at, _G, G_DTYPE, TILE)
    if UNSCALE:
        g = g * inv
    g2 = g * g
    m = load_f32(at, _M, M_DTYPE, TILE) * b1 + omb1 * g
    v = load_f32(at, _V, V_DTYPE, TILE)
    diff = v - g2
    sign = tl.where(diff > 0.0, 1.0, tl.where(diff < 0.0, -1.0, 0.0))  # torch.sign: 0 for 0 (and NaN)
    v_new = tl.where(rule == 0, v * b2 + omb2 * g2, tl.where(rule == 1, v - omb2 * g2 * sign, v + g2))
    store_as(at, m, _M, M_DTYPE, TILE)
    store_as(at, v_new, _V, V_DTYPE, TILE)
    store_as(at, x - step * tl.math.div_rn(m, tl.sqrt_rn(v_new) * c2 + tau), _X, X_DTYPE, TILE)


@triton.jit(do_not_specialize=["n_chunks", "row"])
def fedadam_kernel(
    meta_ptr,
    chunks_ptr,
    n_chunks,
    k_ptr,
    hp_ptr,
    row,
    scale_ptr,
    found_ptr,
    active_ptr,
    NR: tl.constexpr,
    X_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    M_DTYPE: tl.constexpr,
    V_DTYPE: tl.constexpr,
    UNSCALE: tl.constexpr,
    SKIPPABLE: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    BATCHED: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    DT: tl.constexpr = tl.constexpr((X_DTYPE, G_DTYPE, M_DTYPE, V_DTYPE))
    TILE: tl.constexpr = tl.constexpr((NR, ROWS, ALIGNED))
    if live_step(found_ptr, SKIPPABLE):
        inv = inv_scale(scale_ptr, UNSCALE)
        pid = tl.program_id(0)
        if ROWS == 1:
            t, start, n = chunk_of(chunks_ptr, meta_ptr, pid, NR, BLOCK)
            hp_row, client = row_client(meta_ptr, t, row, NR, BATCHED)
            if client_active(active_ptr, client, HAS_ACTIVE):
                hp = _adam_hp(hp_ptr, hp_row, k_ptr, client)
                col = tl.arange(0, BLOCK)
                if start + BLOCK <= n:  # full chunk: unmasked, 128-bit accesses
                    _adam_tile((meta_ptr, t, start, col, None), hp, inv, DT, UNSCALE, TILE)
                else:
                    _adam_tile((meta_ptr, t, start, col, col < n - start), hp, inv, DT, UNSCALE, TILE)
        else:
            t, start, col, mask, hp_row, client = tile_rows(
                chunks_ptr, meta_ptr, active_ptr, pid, n_chunks, row, NR, ROWS, BLOCK, BATCHED, HAS_ACTIVE
            )
            hp = _adam_hp(hp_ptr, hp_row, k_ptr, client)
            _adam_tile((meta_ptr, t, start, col, mask), hp, inv, DT, UNSCALE, TILE)


def launch(
    lau: Launch,
    k: torch.Tensor,
    table: torch.Tensor,
    decay_every: int,
    hp: torch.Tensor,
    amp: Dict[str, Any],
    active: Optional[torch.Tensor] = None,
    step_key: Optional[tuple] = None,
) -> None:
    """One update launch over ``lau``'s tensors (the op has no schedule: ``table`` is unread)."""
    if launch_bound(lau.bound, "fedadam", step_key):
        return
    dt = lau.dtypes
    args = (
        lau.meta,
        lau.chunks,
        lau.n_chunks,
        k,
        hp,
        lau.row,
        amp["scale"],
        amp["found"],
        active if active is not None else k,
    )
    consts = dict(
        NR=lau.meta.shape[1],
        X_DTYPE=dt["x"],
        G_DTYPE=dt["g"],
        M_DTYPE=dt["m"],
        V_DTYPE=dt["v"],
        UNSCALE=amp["UNSCALE"],
        SKIPPABLE=amp["SKIPPABLE"],
        HAS_ACTIVE=active is not None,
        BATCHED=lau.batched,
        ALIGNED=lau.aligned,
        ROWS=lau.rows,
        BLOCK=lau.block,
        **launch_options(),
    )
    run_launch(lau.bound, "fedadam", step_key, fedadam_kernel, (lau.n_tiles,), args, consts)
