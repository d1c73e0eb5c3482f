"""Op "sgd" (FedDecaySGD, NeuronLRSGD): one pass, one launch per dtype signature.

Per element, in float32 (``fedopt_kernels/reference/sgd.py`` is the contract, same order)::

    lr_k = lr * s(min(k // decay_every, len(table) - 1))       # read on the device
    d    = sign * g (+ wd * x) (+ corr) (+ prox_mu * (x - x0))
    buf  = momentum * buf + (1 - dampening) * d ;  d = d + momentum * buf (nesterov) or buf
    x   -= (lr_k * r[row]) * d        (r = per-neuron scale, or lr_k * d without one)

Hyperparameters are runtime float32 arguments (``1 - dampening`` and the maximize sign are
formed on the host); the constexprs are dtypes, which tensors exist, nesterov and the tile shape.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import triton
import triton.language as tl

from .jit_mode import device_fn
from .launcher import Launch, num_warps
from .tiles import chunk_of, load_f32, lr_at_step, row_index, store_as, tile_of

ROLES = ("x", "g", "buf", "x0", "corr", "scale")
WRITTEN = ("x", "buf")
NR = tl.constexpr(len(ROLES) + 2)
_X, _G, _BUF, _X0, _CORR, _SCALE = (tl.constexpr(i) for i in range(len(ROLES)))


@device_fn
def _sgd_tile(meta_ptr, t, start, col, mask, lr_k, momentum, damp1, weight_decay, gsign, prox_mu,
              X_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BUF_DTYPE: tl.constexpr, X0_DTYPE: tl.constexpr,
              CORR_DTYPE: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, HAS_X0: tl.constexpr,
              HAS_CORR: tl.constexpr, HAS_SCALE: tl.constexpr, ROWS: tl.constexpr):
    x = load_f32(meta_ptr, t, start, col, mask, _X, NR, X_DTYPE, ROWS)
    d = load_f32(meta_ptr, t, start, col, mask, _G, NR, G_DTYPE, ROWS) * gsign
    if weight_decay != 0.0:  # runtime branch: 0 * inf must not turn into NaN when wd == 0
        d = d + weight_decay * x
    if HAS_CORR:
        d = d + load_f32(meta_ptr, t, start, col, mask, _CORR, NR, CORR_DTYPE, ROWS)
    if HAS_X0:
        d = d + prox_mu * (x - load_f32(meta_ptr, t, start, col, mask, _X0, NR, X0_DTYPE, ROWS))
    if HAS_MOMENTUM:
        b = load_f32(meta_ptr, t, start, col, mask, _BUF, NR, BUF_DTYPE, ROWS) * momentum + damp1 * d
        store_as(meta_ptr, t, start, col, mask, b, _BUF, NR, BUF_DTYPE, ROWS)
        if NESTEROV:
            d = d + momentum * b
        else:
            d = b
    if HAS_SCALE:
        row0, rows = row_index(meta_ptr, t, start, col, NR)
        r = load_f32(meta_ptr, t, row0, rows, mask, _SCALE, NR, tl.float32, ROWS)
        step = (lr_k * r) * d
    else:
        step = lr_k * d
    store_as(meta_ptr, t, start, col, mask, x - step, _X, NR, X_DTYPE, ROWS)


@triton.jit(do_not_specialize=["n_chunks", "table_len", "decay_every"])
def sgd_kernel(meta_ptr, chunks_ptr, n_chunks, k_ptr, table_ptr, table_len, decay_every,
               lr: tl.float32, momentum: tl.float32, damp1: tl.float32, weight_decay: tl.float32,
               gsign: tl.float32, prox_mu: tl.float32,
               X_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BUF_DTYPE: tl.constexpr, X0_DTYPE: tl.constexpr,
               CORR_DTYPE: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, HAS_X0: tl.constexpr,
               HAS_CORR: tl.constexpr, HAS_SCALE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    lr_k = lr_at_step(k_ptr, table_ptr, table_len, decay_every, lr)
    pid = tl.program_id(0)
    if ROWS == 1:
        t, start, n = chunk_of(chunks_ptr, meta_ptr, pid, NR, BLOCK)
        col = tl.arange(0, BLOCK)
        if start + BLOCK <= n:  # full chunk: unmasked, 128-bit accesses
            _sgd_tile(meta_ptr, t, start, col, None, lr_k, momentum, damp1, weight_decay, gsign, prox_mu,
                      X_DTYPE, G_DTYPE, BUF_DTYPE, X0_DTYPE, CORR_DTYPE,
                      HAS_MOMENTUM, NESTEROV, HAS_X0, HAS_CORR, HAS_SCALE, ROWS)
        else:
            _sgd_tile(meta_ptr, t, start, col, col < n - start, lr_k, momentum, damp1, weight_decay, gsign,
                      prox_mu, X_DTYPE, G_DTYPE, BUF_DTYPE, X0_DTYPE, CORR_DTYPE,
                      HAS_MOMENTUM, NESTEROV, HAS_X0, HAS_CORR, HAS_SCALE, ROWS)
    else:
        t, start, col, mask = tile_of(chunks_ptr, meta_ptr, pid, n_chunks, NR, ROWS, BLOCK)
        _sgd_tile(meta_ptr, t, start, col, mask, lr_k, momentum, damp1, weight_decay, gsign, prox_mu,
                  X_DTYPE, G_DTYPE, BUF_DTYPE, X0_DTYPE, CORR_DTYPE,
                  HAS_MOMENTUM, NESTEROV, HAS_X0, HAS_CORR, HAS_SCALE, ROWS)


def launch(lau: Launch, k: torch.Tensor, table: torch.Tensor, decay_every: int, hp: Dict[str, Any]) -> None:
    """One update launch over ``lau``'s tensors with the group's hyperparameters ``hp``."""
    dt = lau.dtypes
    sgd_kernel[(lau.n_tiles,)](
        lau.meta, lau.chunks, lau.n_chunks, k, table, table.numel(), int(decay_every),
        float(hp["lr"]), float(hp["momentum"]), 1.0 - float(hp["dampening"]), float(hp["weight_decay"]),
        -1.0 if hp["maximize"] else 1.0, float(hp.get("prox_mu", 0.0)),
        X_DTYPE=dt["x"], G_DTYPE=dt["g"], BUF_DTYPE=dt["buf"], X0_DTYPE=dt["x0"], CORR_DTYPE=dt["corr"],
        HAS_MOMENTUM="buf" in lau.present, NESTEROV=bool(hp["nesterov"]) and "buf" in lau.present,
        HAS_X0="x0" in lau.present, HAS_CORR="corr" in lau.present, HAS_SCALE="scale" in lau.present,
        ROWS=lau.rows, BLOCK=lau.block, num_warps=num_warps())
