"""The two-pass (global norm, then update) driver shared by every norm op (FedNAR, PAdaMFed).

An op contributes two device functions (its module's ``elem`` and ``factor``; ``OP`` picks the
module at compile time); this file holds the kernels that walk the tiles and the launch sequence:

* pass 1, ``norm_kernel``: ``min(tiles, MAX_NORM_PROGRAMS)`` programs per launch, program ``p``
  adds ``elem(PASS=0)`` over tiles ``p, p + P, ...`` in a fixed order into its float64 slot;
* pass 2, ``update_kernel``: every program sums all slots in a fixed order (``norm.global_norm``),
  forms its batch's ``factor`` and applies ``elem(PASS=1)`` to its tile. The last launch's program
  0 advances the step counter ``k``.

Roles are addressed by position (role ``i`` of the op's spec); ``DTi`` is role ``i``'s element type
and ``Pi`` whether optional role ``i`` exists in this launch.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import triton
import triton.language as tl

from . import fednar, padamfed
from .jit_mode import device_fn
from .launcher import SLOT_BLOCK, Launch, Plan, num_warps
from .norm import global_norm
from .tiles import chunk_of, inv_scale, live_step, step_increment, tile_of

OPS = {"fednar": (0, fednar), "padamfed": (1, padamfed)}


@device_fn
def _elem(OP: tl.constexpr, meta_ptr, t, start, col, mask, r, inv, scale, PASS: tl.constexpr, NR: tl.constexpr,
          DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, DT4: tl.constexpr,
          P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, UNSCALE: tl.constexpr, ROWS: tl.constexpr):
    if OP == 0:
        out = fednar.elem(meta_ptr, t, start, col, mask, r, inv, scale, PASS, NR, DT0, DT1, DT2, DT3, DT4,
                          P2, P3, P4, UNSCALE, ROWS)
    else:
        out = padamfed.elem(meta_ptr, t, start, col, mask, r, inv, scale, PASS, NR, DT0, DT1, DT2, DT3, DT4,
                            P2, P3, P4, UNSCALE, ROWS)
    return out


@device_fn
def _factor(OP: tl.constexpr, norm, r):
    if OP == 0:
        f = fednar.factor(norm, r)
    else:
        f = padamfed.factor(norm, r)
    return f


@triton.jit(do_not_specialize=["n_chunks", "slot_base", "row"])
def norm_kernel(meta_ptr, chunks_ptr, n_chunks, partials_ptr, slot_base, hp_ptr, row, scale_ptr, found_ptr,
                OP: tl.constexpr, NR: tl.constexpr, HPN: tl.constexpr,
                DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, DT4: tl.constexpr,
                P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, UNSCALE: tl.constexpr,
                SKIPPABLE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_chunks, ROWS)
    r = hp_ptr + row * HPN
    inv = inv_scale(scale_ptr, UNSCALE)
    live = live_step(found_ptr, SKIPPABLE)
    if ROWS == 1:
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        if live:
            for c in range(pid, n_tiles, n_prog):  # fixed order: tiles pid, pid + P, ...
                t, start, n = chunk_of(chunks_ptr, meta_ptr, c, NR, BLOCK)
                col = tl.arange(0, BLOCK)
                if start + BLOCK <= n:
                    acc += _elem(OP, meta_ptr, t, start, col, None, r, inv, 0.0, 0, NR, DT0, DT1, DT2, DT3, DT4,
                                 P2, P3, P4, UNSCALE, ROWS)
                else:
                    acc += _elem(OP, meta_ptr, t, start, col, col < n - start, r, inv, 0.0, 0, NR, DT0, DT1, DT2,
                                 DT3, DT4, P2, P3, P4, UNSCALE, ROWS)
        tl.store(partials_ptr + slot_base + pid, tl.sum(acc, axis=0))
    else:
        acc2 = tl.zeros([ROWS, BLOCK], dtype=tl.float64)
        if live:
            for tile in range(pid, n_tiles, n_prog):
                t, start, col, mask = tile_of(chunks_ptr, meta_ptr, tile, n_chunks, NR, ROWS, BLOCK)
                acc2 += _elem(OP, meta_ptr, t, start, col, mask, r, inv, 0.0, 0, NR, DT0, DT1, DT2, DT3, DT4,
                              P2, P3, P4, UNSCALE, ROWS)
        tl.store(partials_ptr + slot_base + pid, tl.sum(tl.sum(acc2, axis=1), axis=0))


@triton.jit(do_not_specialize=["n_chunks", "n_slots", "row"])
def update_kernel(meta_ptr, chunks_ptr, n_chunks, partials_ptr, n_slots, hp_ptr, row, scale_ptr, found_ptr, k_ptr,
                  OP: tl.constexpr, NR: tl.constexpr, HPN: tl.constexpr,
                  DT0: tl.constexpr, DT1: tl.constexpr, DT2: tl.constexpr, DT3: tl.constexpr, DT4: tl.constexpr,
                  P2: tl.constexpr, P3: tl.constexpr, P4: tl.constexpr, UNSCALE: tl.constexpr,
                  SKIPPABLE: tl.constexpr, ADVANCE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                  SLOT_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    r = hp_ptr + row * HPN
    live = live_step(found_ptr, SKIPPABLE)
    if live:
        scale = _factor(OP, global_norm(partials_ptr, n_slots, SLOT_BLOCK), r)
        inv = inv_scale(scale_ptr, UNSCALE)
        if ROWS == 1:
            t, start, n = chunk_of(chunks_ptr, meta_ptr, pid, NR, BLOCK)
            col = tl.arange(0, BLOCK)
            if start + BLOCK <= n:
                _elem(OP, meta_ptr, t, start, col, None, r, inv, scale, 1, NR, DT0, DT1, DT2, DT3, DT4,
                      P2, P3, P4, UNSCALE, ROWS)
            else:
                _elem(OP, meta_ptr, t, start, col, col < n - start, r, inv, scale, 1, NR, DT0, DT1, DT2, DT3, DT4,
                      P2, P3, P4, UNSCALE, ROWS)
        else:
            t, start, col, mask = tile_of(chunks_ptr, meta_ptr, pid, n_chunks, NR, ROWS, BLOCK)
            _elem(OP, meta_ptr, t, start, col, mask, r, inv, scale, 1, NR, DT0, DT1, DT2, DT3, DT4,
                  P2, P3, P4, UNSCALE, ROWS)
    if ADVANCE:
        if pid == 0:  # no kernel of a norm op reads k: advancing it here races with nothing
            tl.store(k_ptr, tl.load(k_ptr) + step_increment(found_ptr, SKIPPABLE))


@triton.jit
def advance_kernel(k_ptr, found_ptr, SKIPPABLE: tl.constexpr):
    """k += 1 (0 when GradScaler found an inf), after every launch of the step that reads k."""
    tl.store(k_ptr, tl.load(k_ptr) + step_increment(found_ptr, SKIPPABLE))


def _dtype_args(op: str, lau: Launch) -> Dict[str, Any]:
    _, mod = OPS[op]
    roles = mod.ROLES
    dt = [lau.dtypes.get(r, tl.float32) for r in roles] + [tl.float32] * (5 - len(roles))
    pres = [len(roles) > i and roles[i] in lau.present for i in (2, 3, 4)]
    return dict(NR=len(roles) + 2, HPN=mod.HPN, DT0=dt[0], DT1=dt[1], DT2=dt[2], DT3=dt[3], DT4=dt[4],
                P2=pres[0], P3=pres[1], P4=pres[2], ROWS=lau.rows, BLOCK=lau.block)


def launch(op: str, plan: Plan, hp: torch.Tensor, k: torch.Tensor, amp: Dict[str, Any]) -> None:
    """Both passes of ``op`` over every launch of ``plan``, then k += 1 (on the device)."""
    code, _ = OPS[op]
    flags = dict(UNSCALE=amp["UNSCALE"], SKIPPABLE=amp["SKIPPABLE"])
    for lau in plan.launches:
        norm_kernel[(lau.norm_programs,)](
            lau.meta, lau.chunks, lau.n_chunks, plan.partials, lau.slot_base, hp, lau.group, amp["scale"],
            amp["found"], OP=code, **_dtype_args(op, lau), **flags, num_warps=num_warps())
    last = len(plan.launches) - 1
    for i, lau in enumerate(plan.launches):
        update_kernel[(lau.n_tiles,)](
            lau.meta, lau.chunks, lau.n_chunks, plan.partials, plan.n_slots, hp, lau.group, amp["scale"],
            amp["found"], k, OP=code, **_dtype_args(op, lau), **flags, ADVANCE=i == last, SLOT_BLOCK=SLOT_BLOCK,
            num_warps=num_warps())
    if not plan.launches:
        advance(k, amp)


def advance(k: torch.Tensor, amp: Dict[str, Any]) -> None:
    advance_kernel[(1,)](k, amp["found"], SKIPPABLE=amp["SKIPPABLE"])
