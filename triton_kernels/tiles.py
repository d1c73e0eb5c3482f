"""Device-side addressing shared by every kernel: where a program's elements are, and how to load them.

A program covers a *tile*: ``ROWS`` chunks of ``BLOCK`` elements (see ``plans.py``). With
``ROWS == 1`` (compiled) everything is 1-D and scalar per program: ``t`` (tensor index) and
``start`` are scalars, ``col = arange(BLOCK)``. With ``ROWS > 1`` (interpreter) ``t`` and
``start`` are ``[ROWS, 1]`` and ``col`` is ``[1, BLOCK]``; the same helpers serve both shapes.

Client-batched launches (``BATCHED``) address *virtual tensors*: one client's slice of a stacked
``[C, *shape]`` tensor, with two more table columns, its hp row and its client (``row_client``).
Their hyperparameters are then per tensor, i.e. per row of a 2-D tile: ``[ROWS, 1]`` vectors
where the per-client kernels have scalars (the kernels' ``VEC`` switch).

The device functions take what belongs together as one tuple, unpacked by name where it is read:

* ``at = (meta_ptr, t, start, col, mask)``: where a tile's elements are: the pointer table, the
  tensor, the first element, the lanes, the mask (None on the unmasked path);
* ``TILE = (NR, ROWS, ALIGNED)``, a constexpr: the table's row width, the chunks per tile, and
  whether the tensors are promised 16-byte aligned (``plans.py``);
* ``DT`` and ``HAS``, constexprs: each role's element type by slot, and whether each optional role
  is there (the two-pass kernels' ``_elem``).

A constexpr bundle is made with ``tl.constexpr((...))`` and read by unpacking: a bare tuple of
constexprs becomes a tuple of runtime values in the compiled kernels (its branches then no longer
fold away), and an index into a constexpr tuple is one too.
"""

import triton.language as tl

from .jit_mode import device_fn, interpreted

# The interpreter converts float32 -> bfloat16 by truncation (and bfloat16 -> float32 through a
# generic bit-twiddling path); under it, bfloat16 is converted here with integer ops instead,
# rounding to nearest even exactly as torch does. Compiled kernels use the hardware conversions.
INTERPRETED = tl.constexpr(interpreted())


@device_fn
def bf16_to_f32(v):
    return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@device_fn
def f32_to_bf16(v):
    """Round to nearest even; NaN -> the canonical quiet NaN 0x7FC0 (as c10::BFloat16)."""
    u = v.to(tl.uint32, bitcast=True)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    bits = tl.where(v != v, 0x7FC0, rounded)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@device_fn
def role_ptr(meta_ptr, t, ROLE: tl.constexpr, DTYPE: tl.constexpr, TILE: tl.constexpr):
    """Typed pointer to the first element of role ``ROLE`` of tensor ``t``."""
    NR, ROWS, ALIGNED = TILE
    ptr = tl.load(meta_ptr + t * NR + ROLE).to(tl.pointer_type(DTYPE))
    if ROWS == 1 and ALIGNED:
        # the plan stages (or, for client slices, launches apart) every tensor whose address
        # is not 16-byte aligned: this promise is what lets the compiler emit 128-bit accesses on
        # the unmasked path
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@device_fn
def load_f32(at, ROLE: tl.constexpr, DTYPE: tl.constexpr, TILE: tl.constexpr):
    """Elements ``start + col`` of role ``ROLE`` of tensor ``t`` (``at``) as float32.

    The 64-bit ``start`` is added to the base pointer once and the 32-bit ``col`` per element:
    that keeps per-element address math (and registers) small in the compiled kernels.

    Masked-off lanes are undefined (no ``other``: every use of them is masked again, and under
    the interpreter a float ``other`` costs a full-tile dtype conversion)."""
    meta_ptr, t, start, col, mask = at
    p = role_ptr(meta_ptr, t, ROLE, DTYPE, TILE) + start + col
    v = tl.load(p, mask=mask)
    if INTERPRETED and DTYPE == tl.bfloat16:
        v = bf16_to_f32(v)
    return v.to(tl.float32)


@device_fn
def store_as(at, value, ROLE: tl.constexpr, DTYPE: tl.constexpr, TILE: tl.constexpr):
    """Round ``value`` to the role's storage dtype once and store it at ``start + col`` (``at``)."""
    meta_ptr, t, start, col, mask = at
    p = role_ptr(meta_ptr, t, ROLE, DTYPE, TILE) + start + col
    if INTERPRETED and DTYPE == tl.bfloat16:
        tl.store(p, f32_to_bf16(value), mask=mask)
    else:
        tl.store(p, value.to(DTYPE), mask=mask)


@device_fn
def chunk_of(chunks_ptr, meta_ptr, c, NR: tl.constexpr, BLOCK: tl.constexpr):
    """Scalar (tensor index, first element, numel) of chunk ``c`` (compiled 1-D path)."""
    t = tl.load(chunks_ptr + 2 * c)
    j = tl.load(chunks_ptr + 2 * c + 1)
    n = tl.load(meta_ptr + t * NR + (NR - 2))
    start = j.to(tl.int64) * BLOCK
    return t, start, n


@device_fn
def tile_of(chunks_ptr, meta_ptr, tile, n_chunks, NR: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """[ROWS, 1] tensor indices and first elements, [1, BLOCK] columns and the [ROWS, BLOCK] mask
    of tile ``tile`` (interpreter 2-D path). Rows past the last chunk are masked off."""
    # 64-bit indices: the interpreter checks every 32-bit integer op for overflow, which is slow
    c = tile * ROWS + tl.arange(0, ROWS).to(tl.int64)
    valid = c < n_chunks
    t = tl.load(chunks_ptr + 2 * c, mask=valid, other=0).to(tl.int64)[:, None]
    j = tl.load(chunks_ptr + 2 * c + 1, mask=valid, other=0)[:, None]
    n = tl.load(meta_ptr + t * NR + (NR - 2))
    start = j.to(tl.int64) * BLOCK
    col = tl.arange(0, BLOCK)[None, :]
    mask = ((start + col) < n) & valid[:, None]
    return t, start, col, mask


@device_fn
def tile_rows(
    chunks_ptr,
    meta_ptr,
    active_ptr,
    tile,
    n_chunks,
    row,
    NR: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    BATCHED: tl.constexpr,
    HAS_ACTIVE: tl.constexpr,
):
    """``tile_of`` with each row's (hp row, client) (``row_client``); inactive clients' rows are
    masked off."""
    t, start, col, mask = tile_of(chunks_ptr, meta_ptr, tile, n_chunks, NR, ROWS, BLOCK)
    hp_row, client = row_client(meta_ptr, t, row, NR, BATCHED)
    if HAS_ACTIVE:
        mask = mask & client_active(active_ptr, client, HAS_ACTIVE)
    return t, start, col, mask, hp_row, client


@device_fn
def row_index(meta_ptr, t, start, col, NR: tl.constexpr):
    """Rows (first-dim index) of elements ``start + col`` of tensor ``t``, for per-neuron scales,
    as (64-bit base, offsets): one 64-bit division per program, then 32-bit divisions per
    element (rows < 2**31 elements, checked when the plan is built)."""
    rowlen = tl.load(meta_ptr + t * NR + (NR - 1))
    if INTERPRETED:
        # 64-bit lanes: the interpreter checks every 32-bit op for overflow (slow on big tiles)
        base = start * 0
        rel = (start + col) // rowlen
    else:
        base = start // rowlen
        rem = (start - base * rowlen).to(tl.int32)
        rel = (rem + col) // rowlen.to(tl.int32)
    return base, rel


@device_fn
def row_client(meta_ptr, t, row, NR: tl.constexpr, BATCHED: tl.constexpr):
    """(hp row, client) of tensor ``t``: a batched table's two columns before numel and row length;
    for a per-client launch, its one ``row`` and client 0."""
    if BATCHED:
        hp_row = tl.load(meta_ptr + t * NR + (NR - 4))
        client = tl.load(meta_ptr + t * NR + (NR - 3))
    else:
        hp_row = row
        client = 0
    return hp_row, client


@device_fn
def client_active(active_ptr, client, HAS_ACTIVE: tl.constexpr):
    """Whether ``client`` takes this step (the batched ops' ``active`` mask; True without one)."""
    if HAS_ACTIVE:
        act = tl.load(active_ptr + client) != 0
    else:
        act = True
    return act


@device_fn
def add_terms(
    d,
    x,
    weight_decay,
    prox_mu,
    at,
    CORR: tl.constexpr,
    CORR_DT: tl.constexpr,
    HAS_CORR: tl.constexpr,
    X0: tl.constexpr,
    X0_DT: tl.constexpr,
    HAS_X0: tl.constexpr,
    TILE: tl.constexpr,
    VEC: tl.constexpr,
):
    """d + weight_decay * x + correction + prox_mu * (x - x0), in the reference's order (SGD's and
    FedNAR's terms, ``fedopt_kernels.functional.effective_grad``); roles ``CORR`` and ``X0`` (slots,
    element types) are read only when present. ``VEC``: a batched 2-D tile, whose hyperparameters
    are [ROWS, 1] (selects instead of branches)."""
    # wd == 0 must leave d alone: 0 * inf would turn into NaN
    if VEC:
        d = tl.where(weight_decay != 0.0, d + weight_decay * x, d)
    else:
        if weight_decay != 0.0:
            d = d + weight_decay * x
    if HAS_CORR:
        d = d + load_f32(at, CORR, CORR_DT, TILE)
    if HAS_X0:
        d = d + prox_mu * (x - load_f32(at, X0, X0_DT, TILE))
    return d


@device_fn
def lr_at_step(k, table_ptr, table_len, decay_every, lr):
    """lr_k = lr * s(min(k // decay_every, len(table) - 1)) from the float64 ``lr`` and the step
    counter ``k`` (read on the device), rounded to float32 once (as the C++ kernels and the
    reference form it)."""
    j = tl.minimum(k // decay_every, table_len - 1)
    s = tl.load(table_ptr + j)
    return (lr * s).to(tl.float32)


@device_fn
def hp_f32(row_ptr, COL: tl.constexpr):
    """Column ``COL`` of this launch's float64 hp row, as the float32 the math uses."""
    return tl.load(row_ptr + COL).to(tl.float32)


@device_fn
def live_step(found_ptr, SKIPPABLE: tl.constexpr):
    """False when GradScaler found an inf/NaN gradient: then the step changes nothing."""
    if SKIPPABLE:
        live = tl.load(found_ptr) == 0.0
    else:
        live = True
    return live


@device_fn
def step_increment(found_ptr, SKIPPABLE: tl.constexpr):
    """What the step adds to k: 1, or 0 when GradScaler found an inf/NaN gradient."""
    if SKIPPABLE:
        inc = (tl.load(found_ptr) == 0.0).to(tl.int32)
    else:
        inc = 1
    return inc


@device_fn
def inv_scale(scale_ptr, UNSCALE: tl.constexpr):
    """GradScaler's factor: the float32 rounding of 1 / grad_scale formed in float64 (1.0 without one)."""
    if UNSCALE:
        inv = (1.0 / tl.load(scale_ptr).to(tl.float64)).to(tl.float32)  # float64 division is IEEE-rounded
    else:
        inv = 1.0
    return inv
