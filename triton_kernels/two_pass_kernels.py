"""The two-pass (global norm, then update) kernels shared by every norm op (FedNAR, PAdaMFed, FedSAM's ascent).

An op contributes two device functions (its module's ``elem`` and ``factor``; ``OP``, the op's index
in ``OPS``, picks the module at compile time); this file holds the kernels that walk the tiles, and
``two_pass.py`` launches them.

Per-client ops (one global norm):

* pass 1, ``norm_kernel``: ``min(tiles, MAX_NORM_PROGRAMS)`` programs per launch, program ``p``
  adds ``elem(PASS=0)`` over tiles ``p, p + P, ...`` in a fixed order into its float64 slot;
* pass 2, ``update_kernel``: every program sums all slots in a fixed order (``norm.global_norm``),
  forms its row group's ``factor`` and applies ``elem(PASS=1)`` to its tile. The last launch's program
  0 advances the step counter ``k``.

Client-batched ops (``BATCHED``: one norm per client, over that client's slices of every tensor):

* pass 1: one program per tile; each chunk (one client's, as every table row is one client's
  slice) writes its own float64 slot ``slot_base + chunk``; a launch's chunks are client-major;
* ``finalize_kernel``, one program per client: sums the client's slots, launch by launch, in a
  fixed order (``plan.seg`` holds where each client's chunks begin in each launch), forms the
  factor of each of its hp rows ``b * C + c`` into ``plan.factors`` and advances ``k[c]``;
* pass 2: every program reads its table row's factor (one float32) and updates its tile.

Why a finalize kernel rather than the per-client design's "every update program reduces every
slot": with one slot per chunk there are as many slots as update programs, so that reduction
would be quadratic in the model size times the clients (1000 clients of a small CNN: ~7,000
programs each summing ~7,000 slots); the finalize pass reads each slot once, and the update
pass keeps its one extra load per program. The extra launch costs a few microseconds.

Inactive clients (``active``) are skipped by all three (their slots, factors and ``k`` are not
written); ``found_inf`` skips everything. Roles are addressed by position (role ``i`` of the op's
spec); ``DTi`` is role ``i``'s element type and ``Pi`` whether optional role ``i`` exists in this
launch, handed to the ops' math bundled (``DT``, ``HAS``, ``TILE``: ``tiles.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import fedexp, fednar, padamfed, sam_ascent
from .jit_mode import device_fn, loop_bound
from .norm import global_norm
from .tiles import chunk_of, client_active, inv_scale, live_step, row_client, step_increment, tile_of, tile_rows

# each norm op's OP index (the branches of _elem and _factor) and the module of its math
OPS = {"fednar": (0, fednar), "padamfed": (1, padamfed), "sam_ascent": (2, sam_ascent), "fedexp": (3, fedexp)}


@device_fn
def _elem(
    OP: tl.constexpr,
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
    """Op ``OP``'s ``elem`` at ``at`` (``tiles.py``'s bundles): ``DT`` is each role's element type by
    slot (fednar: x, g, x0, corr; padamfed: x, g, D, acc, H; sam_ascent: x, g, saved; fedexp: x, g), ``HAS``
    whether optional roles 2, 3, 4 are there."""
    if OP == 0:
        out = fednar.elem(at, r, inv, factor, PASS, DT, HAS, UNSCALE, TILE, VEC)
    elif OP == 1:
        out = padamfed.elem(at, r, inv, factor, PASS, DT, HAS, UNSCALE, TILE, VEC)
    elif OP == 2:
        out = sam_ascent.elem(at, r, inv, factor, PASS, DT, HAS, UNSCALE, TILE, VEC)
    else:
        out = fedexp.elem(at, r, inv, factor, PASS, DT, HAS, UNSCALE, TILE, VEC)
    return out


@device_fn
def _factor(OP: tl.constexpr, norm, r):
    if OP == 0:
        f = fednar.factor(norm, r)
    elif OP == 1:
        f = padamfed.factor(norm, r)
    elif OP == 2:
        f = sam_ascent.factor(norm, r)
    else:
        f = fedexp.factor(norm, r)
    return f


@triton.jit(do_not_specialize=["n_chunks", "slot_base", "row"])
def norm_kernel(
    meta_ptr,
    chunks_ptr,
    n_chunks,
    partials_ptr,
    slot_base,
    hp_ptr,
    row,
    scale_ptr,
    found_ptr,
    active_ptr,
    OP: tl.constexpr,
    NR: tl.constexpr,
    HPN: tl.constexpr,
    DT0: tl.constexpr,
    DT1: tl.constexpr,
    DT2: tl.constexpr,
    DT3: tl.constexpr,
    DT4: tl.constexpr,
    P2: tl.constexpr,
    P3: tl.constexpr,
    P4: tl.constexpr,
    UNSCALE: tl.constexpr,
    SKIPPABLE: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    BATCHED: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    DT: tl.constexpr = tl.constexpr((DT0, DT1, DT2, DT3, DT4))  # tiles.py's bundles
    HAS: tl.constexpr = tl.constexpr((P2, P3, P4))
    TILE: tl.constexpr = tl.constexpr((NR, ROWS, ALIGNED))
    pid = tl.program_id(0)
    inv = inv_scale(scale_ptr, UNSCALE)
    live = live_step(found_ptr, SKIPPABLE)
    if BATCHED:
        # one program per tile, one slot per chunk (a chunk is one client's)
        if live:
            if ROWS == 1:
                t, start, n = chunk_of(chunks_ptr, meta_ptr, pid, NR, BLOCK)
                hp_row, client = row_client(meta_ptr, t, row, NR, BATCHED)
                if client_active(active_ptr, client, HAS_ACTIVE):
                    r = hp_ptr + hp_row * HPN
                    col = tl.arange(0, BLOCK)
                    if start + BLOCK <= n:
                        sq = _elem(OP, (meta_ptr, t, start, col, None), r, inv, 0.0, 0, DT, HAS, UNSCALE, TILE, False)
                    else:
                        sq = _elem(
                            OP,
                            (meta_ptr, t, start, col, col < n - start),
                            r,
                            inv,
                            0.0,
                            0,
                            DT,
                            HAS,
                            UNSCALE,
                            TILE,
                            False,
                        )
                    tl.store(partials_ptr + slot_base + pid, tl.sum(sq, axis=0))
            else:
                t, start, col, mask, hp_row, client = tile_rows(
                    chunks_ptr, meta_ptr, active_ptr, pid, n_chunks, row, NR, ROWS, BLOCK, BATCHED, HAS_ACTIVE
                )
                sq = _elem(
                    OP,
                    (meta_ptr, t, start, col, mask),
                    hp_ptr + hp_row * HPN,
                    inv,
                    0.0,
                    0,
                    DT,
                    HAS,
                    UNSCALE,
                    TILE,
                    True,
                )
                c = pid * ROWS + tl.arange(0, ROWS)
                tl.store(partials_ptr + slot_base + c, tl.sum(sq, axis=1), mask=c < n_chunks)
    else:
        # per-client: min(tiles, MAX_NORM_PROGRAMS) programs, one slot each
        n_prog = tl.num_programs(0)
        n_tiles = tl.cdiv(n_chunks, ROWS)
        r = hp_ptr + row * HPN
        if ROWS == 1:
            acc = tl.zeros([BLOCK], dtype=tl.float64)
            if live:
                # fixed order: tiles pid, pid + P, ...
                for c in range(loop_bound(pid), loop_bound(n_tiles), loop_bound(n_prog)):
                    t, start, n = chunk_of(chunks_ptr, meta_ptr, c, NR, BLOCK)
                    col = tl.arange(0, BLOCK)
                    if start + BLOCK <= n:
                        acc += _elem(OP, (meta_ptr, t, start, col, None), r, inv, 0.0, 0, DT, HAS, UNSCALE, TILE, False)
                    else:
                        acc += _elem(
                            OP,
                            (meta_ptr, t, start, col, col < n - start),
                            r,
                            inv,
                            0.0,
                            0,
                            DT,
                            HAS,
                            UNSCALE,
                            TILE,
                            False,
                        )
            tl.store(partials_ptr + slot_base + pid, tl.sum(acc, axis=0))
        else:
            acc2 = tl.zeros([ROWS, BLOCK], dtype=tl.float64)
            if live:
                for tile in range(loop_bound(pid), loop_bound(n_tiles), loop_bound(n_prog)):
                    t, start, col, mask = tile_of(chunks_ptr, meta_ptr, tile, n_chunks, NR, ROWS, BLOCK)
                    acc2 += _elem(OP, (meta_ptr, t, start, col, mask), r, inv, 0.0, 0, DT, HAS, UNSCALE, TILE, False)
            tl.store(partials_ptr + slot_base + pid, tl.sum(tl.sum(acc2, axis=1), axis=0))


@device_fn
def _factor_of(
    OP: tl.constexpr, partials_ptr, n_slots, factors_ptr, hp_row, r, BATCHED: tl.constexpr, SLOT_BLOCK: tl.constexpr
):
    """The update's factor: from the global norm (per-client op), or the finalize pass's (batched)."""
    if BATCHED:
        factor = tl.load(factors_ptr + hp_row)
    else:
        factor = _factor(OP, global_norm(partials_ptr, n_slots, SLOT_BLOCK), r)
    return factor


@triton.jit(do_not_specialize=["n_chunks", "n_slots", "row"])
def update_kernel(
    meta_ptr,
    chunks_ptr,
    n_chunks,
    partials_ptr,
    n_slots,
    factors_ptr,
    hp_ptr,
    row,
    scale_ptr,
    found_ptr,
    active_ptr,
    k_ptr,
    OP: tl.constexpr,
    NR: tl.constexpr,
    HPN: tl.constexpr,
    DT0: tl.constexpr,
    DT1: tl.constexpr,
    DT2: tl.constexpr,
    DT3: tl.constexpr,
    DT4: tl.constexpr,
    P2: tl.constexpr,
    P3: tl.constexpr,
    P4: tl.constexpr,
    UNSCALE: tl.constexpr,
    SKIPPABLE: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    BATCHED: tl.constexpr,
    ALIGNED: tl.constexpr,
    ADVANCE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
):
    DT: tl.constexpr = tl.constexpr((DT0, DT1, DT2, DT3, DT4))  # tiles.py's bundles
    HAS: tl.constexpr = tl.constexpr((P2, P3, P4))
    TILE: tl.constexpr = tl.constexpr((NR, ROWS, ALIGNED))
    pid = tl.program_id(0)
    live = live_step(found_ptr, SKIPPABLE)
    if live:
        inv = inv_scale(scale_ptr, UNSCALE)
        if ROWS == 1:
            t, start, n = chunk_of(chunks_ptr, meta_ptr, pid, NR, BLOCK)
            hp_row, client = row_client(meta_ptr, t, row, NR, BATCHED)
            if client_active(active_ptr, client, HAS_ACTIVE):
                r = hp_ptr + hp_row * HPN
                factor = _factor_of(OP, partials_ptr, n_slots, factors_ptr, hp_row, r, BATCHED, SLOT_BLOCK)
                col = tl.arange(0, BLOCK)
                if start + BLOCK <= n:
                    _elem(OP, (meta_ptr, t, start, col, None), r, inv, factor, 1, DT, HAS, UNSCALE, TILE, False)
                else:
                    _elem(
                        OP, (meta_ptr, t, start, col, col < n - start), r, inv, factor, 1, DT, HAS, UNSCALE, TILE, False
                    )
        else:
            t, start, col, mask, hp_row, client = tile_rows(
                chunks_ptr, meta_ptr, active_ptr, pid, n_chunks, row, NR, ROWS, BLOCK, BATCHED, HAS_ACTIVE
            )
            r = hp_ptr + hp_row * HPN
            factor = _factor_of(OP, partials_ptr, n_slots, factors_ptr, hp_row, r, BATCHED, SLOT_BLOCK)
            _elem(OP, (meta_ptr, t, start, col, mask), r, inv, factor, 1, DT, HAS, UNSCALE, TILE, BATCHED)
    if ADVANCE:
        if pid == 0:  # no kernel of a norm op reads k: advancing it here races with nothing
            tl.store(k_ptr, tl.load(k_ptr) + step_increment(found_ptr, SKIPPABLE))


@triton.jit(do_not_specialize=["n_launches", "n_clients", "n_rows"])
def finalize_kernel(
    partials_ptr,
    seg_ptr,
    n_launches,
    n_clients,
    factors_ptr,
    hp_ptr,
    n_rows,
    found_ptr,
    active_ptr,
    k_ptr,
    OP: tl.constexpr,
    HPN: tl.constexpr,
    SKIPPABLE: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
    CLIENTS: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
):
    """Clients ``c`` of this program (``CLIENTS`` of them: 1 compiled, many under the interpreter,
    whose cost is per program): the norm over each one's slots of every launch
    (``seg[l, c]:seg[l, c + 1]``, launch by launch, lane ``i`` taking slots ``i, i + SLOT_BLOCK``, ...),
    the factor of each of its hp rows, and ``k[c] += 1``. Inactive clients are left alone."""
    c = tl.program_id(0) * CLIENTS + tl.arange(0, CLIENTS)
    inside = c < n_clients
    todo = inside
    if HAS_ACTIVE:
        todo = todo & (tl.load(active_ptr + c, mask=inside, other=0) != 0)
    c = tl.where(inside, c, 0)  # in-bounds addresses for the lanes past the last client (never stored)
    if live_step(found_ptr, SKIPPABLE):
        lane = tl.arange(0, SLOT_BLOCK)[None, :]
        acc = tl.zeros([CLIENTS, SLOT_BLOCK], dtype=tl.float64)
        for lau in range(loop_bound(n_launches)):
            base = seg_ptr + lau * (n_clients + 1) + c
            lo = tl.load(base, mask=todo, other=0)
            hi = tl.load(base + 1, mask=todo, other=0)
            for s0 in range(0, loop_bound(tl.max(hi - lo, axis=0)), SLOT_BLOCK):
                idx = (lo + s0)[:, None] + lane
                acc += tl.load(partials_ptr + idx, mask=idx < hi[:, None], other=0.0)
        norm = tl.sqrt(tl.sum(acc, axis=1))  # float64 sqrt: IEEE-rounded, inf/NaN propagate
        for b in range(loop_bound(n_rows)):
            hp_row = b * n_clients + c
            tl.store(factors_ptr + hp_row, _factor(OP, norm, hp_ptr + hp_row * HPN), mask=todo)
        tl.store(k_ptr + c, tl.load(k_ptr + c, mask=todo, other=0) + 1, mask=todo)


@triton.jit(do_not_specialize=["n_clients"])
def advance_kernel(
    k_ptr, found_ptr, active_ptr, n_clients, SKIPPABLE: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLOCK: tl.constexpr
):
    """k[c] += 1 for every (active) client (0 when GradScaler found an inf), after every launch of the
    step that reads k. A per-client op has one client."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = c < n_clients
    inc = step_increment(found_ptr, SKIPPABLE)
    if HAS_ACTIVE:
        inc = inc * (tl.load(active_ptr + c, mask=inside, other=0) != 0).to(tl.int32)
    tl.store(k_ptr + c, tl.load(k_ptr + c, mask=inside) + inc, mask=inside)
