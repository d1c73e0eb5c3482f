"""Op "sgd" (FedDecaySGD, NeuronLRSGD): one pass, one launch per row group and dtype signature.

Per element, in float32 (``fedopt_kernels/core/reference.py``'s ``sgd_step`` is the contract, same order)::

    lr_k = lr * s(min(k // decay_every, len(table) - 1))       # read on the device
    d    = g * inv_scale (GradScaler) ; d = -d (maximize) (+ wd * x) (+ corr) (+ prox_mu * (x - x0))
    buf  = momentum * buf + (1 - dampening) * d ;  d = d + momentum * buf (nesterov) or buf
    x   -= (lr_k * r[row]) * d        (r = per-neuron scale, or lr_k * d without one)

Hyperparameters are read from the row group's float64 row of ``hp`` on the device; the constexprs are
dtypes, which tensors exist, whether GradScaler is in use, and the tile shape.

The same kernel runs ``sgd_batched`` (``BATCHED``): each tensor of the table is one client's slice,
with its own hp row and client, so ``k`` (hence ``lr_k``) is the client's, an inactive client's
tiles are skipped, and under the round's FRESH bit (a per-launch flag) a client at ``k == 0``
takes ``dampening = 0`` (``buf = d``, torch's first step).
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
from .tiles import (
    add_terms,
    chunk_of,
    client_active,
    hp_f32,
    inv_scale,
    live_step,
    load_f32,
    lr_at_step,
    row_client,
    row_index,
    store_as,
    tile_rows,
)

# role slots and hp columns, from the op's declaration (fedopt_kernels/core/ops.py)
ROLES, WRITTEN = spec_roles("sgd")
_X, _G, _BUF, _X0, _CORR, _SCALE = spec_slots("sgd", "x", "g", "buf", "x0", "corr", "scale")
_LR, _MOM, _DAMP, _WD, _PROX, _NEST, _MAX, HPN = spec_columns(
    "sgd", "lr", "momentum", "dampening", "weight_decay", "prox_mu", "nesterov", "maximize"
)


@device_fn
def _sgd_hp(hp_ptr, hp_row, k_ptr, client, table_ptr, table_len, decay_every, fresh, BATCHED: tl.constexpr):
    """The float32 factors of hp row ``hp_row`` (scalars, or [ROWS, 1] for a batched 2-D tile)."""
    r = hp_ptr + hp_row * HPN
    k = tl.load(k_ptr + client)
    lr_k = lr_at_step(k, table_ptr, table_len, decay_every, tl.load(r + _LR))
    damp = tl.load(r + _DAMP)
    if BATCHED:  # FRESH round, client's first step: buf = d (the per-client op's first-step hp row)
        damp = tl.where((fresh != 0) & (k == 0), 0.0, damp)
    damp1 = (1.0 - damp).to(tl.float32)
    nesterov = tl.load(r + _NEST) != 0.0
    gsign = tl.where(tl.load(r + _MAX) != 0.0, -1.0, 1.0).to(tl.float32)
    return lr_k, hp_f32(r, _MOM), damp1, hp_f32(r, _WD), gsign, hp_f32(r, _PROX), nesterov


@device_fn
def _sgd_tile(
    at, hp, inv, DT: tl.constexpr, HAS: tl.constexpr, UNSCALE: tl.constexpr, TILE: tl.constexpr, BATCHED: tl.constexpr
):
    """The SGD update at ``at`` (``tiles.py``'s bundles). ``hp``: ``_sgd_hp``'s factors; ``DT``: the
    element types of x, g, buf, x0, corr; ``HAS``: whether buf, x0, corr and scale are there."""
    lr_k, momentum, damp1, weight_decay, gsign, prox_mu, nesterov = hp
    X_DTYPE, G_DTYPE, BUF_DTYPE, X0_DTYPE, CORR_DTYPE = DT
    HAS_MOMENTUM, HAS_X0, HAS_CORR, HAS_SCALE = HAS
    NR, ROWS, ALIGNED = TILE
    VEC: tl.constexpr = BATCHED and ROWS > 1  # hyperparameters are [ROWS, 1]: selects instead of branches
    x = load_f32(at, _X, X_DTYPE, TILE)
    d = load_f32(at, _G, G_DTYPE, TILE)
    if UNSCALE:
        d = d * inv
    d = add_terms(
        d * gsign,
        x,
        weight_decay,
        prox_mu,
        at,
        _CORR,
        CORR_DTYPE,
        HAS_CORR,
        _X0,
        X0_DTYPE,
        HAS_X0,
        TILE,
        VEC,
    )
    if HAS_MOMENTUM:
        b = load_f32(at, _BUF, BUF_DTYPE, TILE) * momentum + damp1 * d
        store_as(at, b, _BUF, BUF_DTYPE, TILE)
        if VEC:
            d = tl.where(nesterov, d + momentum * b, b)
        else:
            if nesterov:
                d = d + momentum * b
            else:
                d = b
    if HAS_SCALE:
        meta_ptr, t, start, col, mask = at
        row0, rows = row_index(meta_ptr, t, start, col, NR)
        # a client's slice of a [C, M] scale is aligned only when M is: never promised when batched
        r = load_f32(
            (meta_ptr, t, row0, rows, mask), _SCALE, tl.float32, tl.constexpr((NR, ROWS, ALIGNED and not BATCHED))
        )
        step = (lr_k * r) * d
    else:
        step = lr_k * d
    store_as(at, x - step, _X, X_DTYPE, TILE)


@triton.jit(do_not_specialize=["n_chunks", "table_len", "decay_every", "row", "fresh"])
def sgd_kernel(
    meta_ptr,
    chunks_ptr,
    n_chunks,
    k_ptr,
    table_ptr,
    table_len,
    decay_every,
    hp_ptr,
    row,
    fresh,
    scale_ptr,
    found_ptr,
    active_ptr,
    NR: tl.constexpr,
    X_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    BUF_DTYPE: tl.constexpr,
    X0_DTYPE: tl.constexpr,
    CORR_DTYPE: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    HAS_X0: tl.constexpr,
    HAS_CORR: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    UNSCALE: tl.constexpr,
    SKIPPABLE: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    BATCHED: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    DT: tl.constexpr = tl.constexpr((X_DTYPE, G_DTYPE, BUF_DTYPE, X0_DTYPE, CORR_DTYPE))  # tiles.py's bundles
    HAS: tl.constexpr = tl.constexpr((HAS_MOMENTUM, HAS_X0, HAS_CORR, HAS_SCALE))
    TILE: tl.constexpr = tl.constexpr((NR, ROWS, ALIGNED))
    if live_step(found_ptr, SKIPPABLE):
        inv = inv_scale(scale_ptr, UNSCALE)
        pid = tl.program_id(0)
        if ROWS == 1:
            t, start, n = chunk_of(chunks_ptr, meta_ptr, pid, NR, BLOCK)
            hp_row, client = row_client(meta_ptr, t, row, NR, BATCHED)
            if client_active(active_ptr, client, HAS_ACTIVE):
                hp = _sgd_hp(hp_ptr, hp_row, k_ptr, client, table_ptr, table_len, decay_every, fresh, BATCHED)
                col = tl.arange(0, BLOCK)
                if start + BLOCK <= n:  # full chunk: unmasked, 128-bit accesses
                    _sgd_tile((meta_ptr, t, start, col, None), hp, inv, DT, HAS, UNSCALE, TILE, BATCHED)
                else:
                    _sgd_tile((meta_ptr, t, start, col, col < n - start), hp, inv, DT, HAS, UNSCALE, TILE, BATCHED)
        else:
            t, start, col, mask, hp_row, client = tile_rows(
                chunks_ptr, meta_ptr, active_ptr, pid, n_chunks, row, NR, ROWS, BLOCK, BATCHED, HAS_ACTIVE
            )
            hp = _sgd_hp(hp_ptr, hp_row, k_ptr, client, table_ptr, table_len, decay_every, fresh, BATCHED)
            _sgd_tile((meta_ptr, t, start, col, mask), hp, inv, DT, HAS, UNSCALE, TILE, BATCHED)


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
    """One update launch over ``lau``'s tensors: per-client, with its row group's row of ``hp``;
    batched (``lau.batched``), with each table row's own hp row and client. ``step_key``: what of the
    other arguments may change between steps (``launcher.launch``)."""
    if launch_bound(lau.bound, "sgd", step_key):
        return
    dt = lau.dtypes
    args = (
        lau.meta,
        lau.chunks,
        lau.n_chunks,
        k,
        table,
        table.numel(),
        int(decay_every),
        hp,
        lau.row,
        lau.fresh,
        amp["scale"],
        amp["found"],
        active if active is not None else k,
    )
    consts = dict(
        NR=lau.meta.shape[1],
        X_DTYPE=dt["x"],
        G_DTYPE=dt["g"],
        BUF_DTYPE=dt["buf"],
        X0_DTYPE=dt["x0"],
        CORR_DTYPE=dt["corr"],
        HAS_MOMENTUM="buf" in lau.present,
        HAS_X0="x0" in lau.present,
        HAS_CORR="corr" in lau.present,
        HAS_SCALE="scale" in lau.present,
        UNSCALE=amp["UNSCALE"],
        SKIPPABLE=amp["SKIPPABLE"],
        HAS_ACTIVE=active is not None,
        BATCHED=lau.batched,
        ALIGNED=lau.aligned,
        ROWS=lau.rows,
        BLOCK=lau.block,
        **launch_options(),
    )
    run_launch(lau.bound, "sgd", step_key, sgd_kernel, (lau.n_tiles,), args, consts)
