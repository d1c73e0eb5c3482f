"""Launch plans: what lets one kernel launch cover every tensor of a pass (launched by ``launcher.py``).

A plan is built once per set of tensors and holds their pointer tables, chunk maps, staging buffers
and norm slots; the launches themselves, and the op constants the kernels take, are ``launcher.py``'s.

Design (the same for every op):

* **Pointer table.** For each launch a device ``int64`` tensor ``meta`` of shape ``[T, NR]`` holds,
  per tensor ``t``, the raw address of each role (param, grad, momentum buffer, ...; 0 where a
  role is absent), then its ``numel`` and its row length (``numel // shape[0]``, for per-neuron
  scales). Kernels load an address and cast it with ``.to(tl.pointer_type(DTYPE))``. The element
  type of each role is a ``tl.constexpr`` (a structural switch), so tensors are grouped into one
  launch per *dtype signature* (e.g. fp32 params in one launch, bf16 params in another).
* **Chunk map.** An ``int32`` tensor ``[C, 2]`` maps chunk ``c`` to (tensor index, chunk index
  within that tensor); a chunk is ``BLOCK`` consecutive elements. A program handles ``ROWS``
  consecutive chunks (a "tile").
* **Raw addresses work in both modes.** Compiled, they are device addresses. Under
  ``TRITON_INTERPRET=1`` the interpreter reads and writes memory through the raw addresses of
  the numpy lanes, so the same table works for CPU tensors (only tensors passed as *arguments*
  are copied to the host by the interpreter; the table itself is one of them, the data is not).
  CUDA tensors under the interpreter would be dereferenced on the host, so the backend refuses
  that combination (see ``fedopt_kernels/core/backends/triton.py``).
* **Two tile shapes.** Compiled (GPU): ``ROWS == 1``: a program is one chunk, the pointer is
  marked 16-byte aligned (``tl.multiple_of``), and full chunks take an unmasked branch, so
  float32 loads/stores are 128-bit (``ld.global.v4``). Interpreted: the interpreter pays ~0.1 ms
  of Python per Triton op *per program*, so many programs are slow; ``ROWS > 1`` packs many
  chunks (of many small tensors) into one 2-D ``[ROWS, BLOCK]`` program with a mask, which makes
  a step over hundreds of tensors take milliseconds. The math helpers are shared by both shapes.
* **Alignment / layout.** Tensors that are non-contiguous, or whose address is not 16-byte
  aligned (views at odd offsets), are *staged*: the plan owns a contiguous buffer per such
  tensor; it is filled before the launches and copied back after (only for written roles). This
  keeps the table stable across steps and the fast path's alignment promise true.
* **Cache.** A plan (tables, chunk maps, staging buffers, norm partial slots) is cached under a
  key made of every tensor's (data_ptr, shape, stride, dtype) and the device; it is rebuilt only
  when that set changes. The cache holds no reference to user tensors (a freed tensor's address
  may be reused by a new one with the same shape, which the same table serves correctly).
* **Moved gradients.** ``zero_grad(set_to_none=True)`` gives each step new gradient tensors, maybe
  at new addresses, with everything else in place. ``LaunchPlan.moved`` then makes the plan for
  the new addresses from the old one: the same chunk maps, staging buffers and slots, and a copy of
  each pointer table with the moved roles' column rewritten (one host-to-device copy per launch),
  instead of building every table again.
* **Deterministic global norms.** A norm pass runs ``min(tiles, MAX_NORM_PROGRAMS)`` programs;
  program ``p`` sums squares (in float64: no overflow or underflow for elements in [1e-30, 1e30])
  over tiles ``p, p + P, ...`` in a fixed order into slot ``slot_base + p`` of ``plan.partials``
  (float64, no atomics). The update pass of every launch reduces all slots in a fixed order on the
  device. Nothing is read back to the host.

* **Client-batched plans** (``get_batched_plan``, the ``<op>_batched`` ops): every tensor is a
  stack ``[C, *shape]``; each client's slice is a *virtual tensor*, one table row with its own
  address (``base + c * stride(0)``) and two more columns, its hp row ``b * C + c`` and its client
  ``c``, so one launch covers every tensor of every client. Rows are grouped into launches by
  (roles present, dtypes, 16-byte alignment of the slice, FRESH), client-major. Norm ops get one
  partial slot per chunk and a per-client ``seg`` table for ``two_pass_kernels.finalize_kernel``.

Building a plan copies the tables to the device (pinned + non_blocking on CUDA: no host sync);
this happens only on a cache miss, i.e. not in a steady-state or CUDA-graph-captured step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from .jit_mode import interpreted
from .launcher import tl_dtype

# Compiled (GPU) tile: one chunk of 2048 elements per program; with ``launcher.GPU_NUM_WARPS`` (8 warps)
# that is 8 elements per thread, i.e. two 128-bit accesses per float32 tensor per thread; keeps the
# fullest variant (sgd with momentum, x0, correction and scales) near 70 registers (16 elements/thread
# needed ~150).
GPU_BLOCK = 2048
# Interpreter tiles: about this many lanes per program (numpy work per op), see pick_tile().
INTERP_LANES = 1 << 17
# Cap on norm-pass programs per launch: bounds the slots every update program must reduce.
MAX_NORM_PROGRAMS = 512
# Plans kept (LRU). Each owns device tables and staging buffers.
CACHE_SIZE = 8
# Tests set (ROWS, BLOCK) here to run the compiled kernels' 1-D path (ROWS == 1) under the
# interpreter; None picks the tile with pick_tile().
FORCE_TILE: Optional[Tuple[int, int]] = None


@dataclass
class Launch:
    """One kernel launch: the tensors of one group that share a dtype signature."""

    dtypes: Dict[str, tl.dtype]  # role -> element type (absent roles map to tl.float32)
    present: Tuple[str, ...]  # roles that have tensors
    meta: torch.Tensor  # int64 [T, NR]: addresses per role, numel, row length
    chunks: torch.Tensor  # int32 [C, 2]: (tensor index, chunk index in tensor)
    n_chunks: int
    rows: int  # chunks per program (1 compiled)
    block: int  # elements per chunk
    n_tiles: int  # programs of an elementwise pass
    row: int = 0  # the hp row (of its row group) of the tensors (per-client launches)
    norm_programs: int = 0  # programs of a norm pass
    slot_base: int = 0  # first slot of this launch in LaunchPlan.partials
    batched: bool = False  # rows are client slices: meta is [T, NR + 2] (hp row, client)
    aligned: bool = True  # every role of every row is 16-byte aligned (the ROWS == 1 promise)
    fresh: int = 0  # sgd_batched: the FRESH bit of this launch's row groups
    consts: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # op -> its constexprs
    bound: Dict[str, Any] = field(
        default_factory=dict, compare=False, repr=False
    )  # kernel -> Bound (``launcher.launch``)
    # where each table row's addresses come from (LaunchPlan.moved): its source tensor (an index into
    # LaunchPlan.sources) and client (0 for a per-client plan); and the table as built, on the host
    row_source: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    row_client: Optional[np.ndarray] = field(default=None, compare=False, repr=False)
    host_meta: Optional[np.ndarray] = field(default=None, compare=False, repr=False)


@dataclass
class LaunchPlan:
    """Everything a step needs besides the per-step scalars, built once per tensor set (the Triton
    launches; the optimizer's own plan is ``core/plan.py``'s ``StepPlan``)."""

    launches: List[Launch]
    partials: Optional[torch.Tensor]  # float64 [n_slots] or None
    n_slots: int
    staged: List[Tuple[int, str, int, torch.Tensor, bool]] = field(default_factory=list)
    # (position in the roles list, role, index in its lists, contiguous staging buffer, written by the op)
    clients: int = 0  # batched plans: C (0: a per-client plan)
    hp_rows: int = 0  # batched plans: B of hp [B, C, cols]
    seg: Optional[torch.Tensor] = None  # batched norm: int32 [launches, C + 1], slot where client c begins
    factors: Optional[torch.Tensor] = None  # batched norm: float32 [B * C], each hp row's update factor
    role_names: Tuple[str, ...] = ()  # the pointer table's role columns, in order
    sources: List[Tuple[int, int]] = field(default_factory=list)  # (row group, index in its lists) of each table tensor
    device: Optional[torch.device] = None
    columns: Dict[str, Tuple[int, np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)  # _column's
    bound: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # plan-wide launches' Bound

    @property
    def batched(self) -> bool:
        return self.clients > 0

    def moved(self, roles: Sequence[Dict[str, List[torch.Tensor]]], moving: Sequence[str]) -> LaunchPlan:
        """This plan for ``roles``, whose ``moving`` roles (e.g. the gradients) may sit at other
        addresses than the ones this plan was built for, with the same shapes, strides, dtypes and
        16-byte alignment (so the same rows are staged and the same launches keep the 128-bit
        promise; the caller checks that). Chunk maps, staging buffers and norm slots are shared;
        each launch gets a copy of its pointer table with those roles' columns rewritten."""
        cols = []
        for role in moving:
            if role not in self.role_names:
                continue
            col, keep, step = self._column(roles, role)
            base = np.fromiter(
                (roles[g][role][i].data_ptr() if role in roles[g] else 0 for g, i in self.sources),
                dtype=np.int64,
                count=len(self.sources),
            )
            cols.append((col, base, step, keep))
        launches = []
        assert self.device is not None
        with _table_pool(self.device):
            for lau in self.launches:
                assert lau.host_meta is not None and lau.row_source is not None and lau.row_client is not None
                host = lau.host_meta.copy()
                src, client = lau.row_source, lau.row_client
                for col, base, step, keep in cols:
                    host[:, col] = np.where(keep[src], host[:, col], base[src] + client * step[src])
                meta = _to_device(torch.from_numpy(host), self.device)
                launches.append(dataclasses.replace(lau, meta=meta, host_meta=host, bound={}))
        return dataclasses.replace(self, launches=launches, bound={})

    def _column(self, roles: Sequence[Dict[str, List[torch.Tensor]]], role: str) -> Tuple[int, np.ndarray, np.ndarray]:
        """``role``'s table column; per source tensor, whether its column entry stays (the role is
        absent, or staged: the row holds the buffer's address) and its client stride in bytes
        (batched). Fixed by the plan's layout, so worked out once."""
        known = self.columns.get(role)
        if known is None:
            staged = {(g, name, i) for g, name, i, _, _ in self.staged}
            keep = [role not in roles[g] or (g, role, i) in staged for g, i in self.sources]
            step = [
                0 if (k or not self.batched) else roles[g][role][i].stride(0) * roles[g][role][i].element_size()
                for k, (g, i) in zip(keep, self.sources, strict=True)
            ]
            known = self.columns[role] = (
                self.role_names.index(role),
                np.asarray(keep, dtype=bool),
                np.asarray(step, dtype=np.int64),
            )
        return known

    def stage_in(self, roles: Sequence[Dict[str, List[torch.Tensor]]]) -> None:
        """Copy the user's non-contiguous / misaligned tensors into the staging buffers."""
        for g, role, i, buf, _ in self.staged:
            buf.copy_(roles[g][role][i])

    def stage_out(self, roles: Sequence[Dict[str, List[torch.Tensor]]]) -> None:
        """Copy written staging buffers back into the user's tensors."""
        for g, role, i, buf, written in self.staged:
            if written:
                roles[g][role][i].copy_(buf)


_CACHE: OrderedDict[tuple, LaunchPlan] = OrderedDict()
# Counters for the tests: plans built, steps that reused one, plans made for moved gradients.
stats = {"builds": 0, "hits": 0, "moved": 0}


def clear_cache() -> None:
    _CACHE.clear()


def _key_of(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)


def pick_tile(numels: Sequence[int], interp: bool) -> Tuple[int, int]:
    """(ROWS, BLOCK) for one launch. Compiled: (1, GPU_BLOCK). Interpreted: a block near the mean
    tensor size (few wasted lanes on small tensors) and enough rows for ~INTERP_LANES lanes."""
    if not interp:
        return 1, GPU_BLOCK
    mean = max(1, sum(numels) // max(1, len(numels)))
    block = min(4096, max(64, triton.next_power_of_2(mean)))
    rows = max(1, INTERP_LANES // block)
    return rows, block


def _chunk_map(numels: List[int], block: int) -> torch.Tensor:
    # numpy: torch.repeat_interleave costs ~20 ms per call on CPU here, even for ten elements
    counts = (np.asarray(numels, dtype=np.int64) + block - 1) // block
    tensor_idx = np.repeat(np.arange(len(numels), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
    return torch.from_numpy(np.stack([tensor_idx, within], 1).astype(np.int32))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # pinned + non_blocking: the copy is queued on the stream, the host does not wait
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def plan_key(
    op: str,
    roles: Sequence[Dict[str, List[torch.Tensor]]],
    rows: Sequence[int],
    role_names: Tuple[str, ...],
    device: torch.device,
    norm: bool,
) -> tuple:
    """What a plan depends on: every tensor's address, shape, strides and dtype, and the hp rows."""
    return (
        op,
        device,
        norm,
        tuple(rows),
        tuple(tuple(tuple(map(_key_of, r[name])) if name in r else None for name in role_names) for r in roles),
    )


def get_plan(
    op: str,
    roles: Sequence[Dict[str, List[torch.Tensor]]],
    rows: Sequence[int],
    role_names: Tuple[str, ...],
    written: Tuple[str, ...],
    device: torch.device,
    norm: bool,
    scale_role: Optional[str] = None,
    key: Optional[tuple] = None,
) -> LaunchPlan:
    """The cached plan for these tensors (one dict role -> list per row group, ``rows[i]`` the hp row of
    row group ``i``), building it on a miss.

    ``role_names`` fixes the column order of the pointer table (the kernels' ROLE constants);
    ``written`` names the roles the op stores into; ``norm`` asks for partial slots;
    ``scale_role`` names the per-row scale role whose row length goes into the table.
    """
    if key is None:
        key = plan_key(op, roles, rows, role_names, device, norm)
    return _cached(key, device, lambda: _build(roles, rows, role_names, written, device, norm, scale_role))


def get_batched_plan(
    op: str,
    roles: Sequence[Dict[str, List[torch.Tensor]]],
    rows: Sequence[int],
    fresh: Sequence[bool],
    clients: int,
    hp_rows: int,
    role_names: Tuple[str, ...],
    written: Tuple[str, ...],
    device: torch.device,
    norm: bool,
    scale_role: Optional[str] = None,
) -> LaunchPlan:
    """``get_plan`` for a client-batched op: every tensor is stacked ``[clients, *shape]``, row group
    ``i`` uses hp rows ``rows[i] * clients + c`` of hp viewed as ``[hp_rows * clients, cols]``,
    and ``fresh[i]`` is its FRESH bit (``sgd_batched``)."""
    key = ("batched", clients, hp_rows, tuple(bool(f) for f in fresh)) + plan_key(
        op, roles, rows, role_names, device, norm
    )
    return _cached(
        key,
        device,
        lambda: _build_batched(roles, rows, fresh, clients, hp_rows, role_names, written, device, norm, scale_role),
    )


def _cached(key: tuple, device: torch.device, build) -> LaunchPlan:
    plan = _CACHE.get(key)
    if plan is not None:
        _CACHE.move_to_end(key)
        stats["hits"] += 1
        return plan
    refuse_while_capturing(device)
    with _table_pool(device):
        plan = build()
    _CACHE[key] = plan
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    stats["builds"] += 1
    return plan


def refuse_while_capturing(device: torch.device) -> None:
    """A new pointer table is copied from a temporary host buffer, which a graph replay would
    re-read: never while a CUDA graph is being captured."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the triton backend builds its pointer tables when it first sees a set of tensors; take one "
            "eager step() before capturing a CUDA graph, and keep parameters, gradients and optimizer "
            "state at fixed addresses while the graph is used"
        )


_POOLS: Dict[int, Any] = {}  # device index -> its MemPool, or None where pools are not to be had


@contextlib.contextmanager
def _table_pool(device: torch.device):
    """Allocate a plan's tables and buffers from a private CUDA memory pool. From the shared pool
    they would take the blocks the caching allocator hands to the next gradients, so a loop with
    ``zero_grad(set_to_none=True)`` would never see its gradient addresses again: every step would
    miss this cache and none could be replayed (core/replay.py). Where torch has no pools, or one
    cannot be made, the tables come from the shared pool as before."""
    use, make = getattr(torch.cuda, "use_mem_pool", None), getattr(torch.cuda, "MemPool", None)
    if device.type != "cuda" or use is None or make is None:
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        try:
            with torch.cuda.device(index):  # a pool belongs to the device current at its creation
                _POOLS[index] = make()
        except (RuntimeError, TypeError):  # an allocator configuration without pools
            _POOLS[index] = None
    pool = _POOLS[index]
    routing = use(pool, device=index) if pool is not None else None
    try:
        if routing is not None:
            routing.__enter__()
    except RuntimeError:
        _POOLS[index] = routing = None
    try:
        yield
    finally:
        if routing is not None:
            routing.__exit__(None, None, None)


def _check_rowlen(rowlen: int, shape: tuple) -> None:
    if rowlen >= 2**31 - 2 * GPU_BLOCK:
        raise ValueError(
            f"a parameter of shape {shape} has rows of {rowlen} elements; "
            f"the triton backend's per-row scale supports rows below 2**31 elements"
        )


def _launch_of(
    rows_meta: List[List[int]],
    numels: List[int],
    nr: int,
    present: Tuple[str, ...],
    sig: tuple,
    role_names: Tuple[str, ...],
    device: torch.device,
    interp: bool,
    sources: List[int],
    clients: Optional[List[int]] = None,
    **kw,
) -> Launch:
    """One launch over the table rows ``rows_meta`` (their element counts ``numels``; row ``j`` holds
    the addresses of source tensor ``sources[j]``, client ``clients[j]``)."""
    rows, block = FORCE_TILE or pick_tile(numels, interp)
    chunks = _chunk_map(numels, block)
    n_chunks = chunks.shape[0]
    if kw.get("batched") and FORCE_TILE is None:
        # no more rows than chunks: the interpreter's cost is per lane, used or not
        rows = min(rows, triton.next_power_of_2(n_chunks))
    dtypes = {name: tl.float32 for name in role_names}
    dtypes.update(zip(present, sig, strict=True))
    host = np.asarray(rows_meta, dtype=np.int64).reshape(len(rows_meta), nr)
    return Launch(
        dtypes=dtypes,
        present=present,
        meta=_to_device(torch.from_numpy(host.copy()), device),
        chunks=_to_device(chunks.contiguous(), device),
        n_chunks=n_chunks,
        rows=rows,
        block=block,
        n_tiles=(n_chunks + rows - 1) // rows,
        row_source=np.asarray(sources, dtype=np.int64),
        row_client=np.asarray(clients if clients is not None else [0] * len(sources), dtype=np.int64),
        host_meta=host,
        **kw,
    )


def _build(roles, rows_of, role_names, written, device, norm, scale_role) -> LaunchPlan:
    interp = interpreted()
    nr = len(role_names) + 2
    launches: List[Launch] = []
    staged: List[Tuple[int, str, int, torch.Tensor, bool]] = []
    sources: List[Tuple[int, int]] = []
    for g, r in enumerate(roles):
        present = tuple(name for name in role_names if name in r)
        n = len(r[role_names[0]])
        # split the group by dtype signature, keeping first-seen order (deterministic)
        by_sig: OrderedDict[tuple, List[int]] = OrderedDict()
        for i in range(n):
            if r[role_names[0]][i].numel() == 0:
                continue  # zero-size: nothing to do, nothing in the table
            sig = tuple(tl_dtype(r[name][i], name) for name in present)
            by_sig.setdefault(sig, []).append(i)
        for sig, idx in by_sig.items():
            rows_meta = []
            numels = []
            first = len(sources)
            for i in idx:
                sources.append((g, i))
                addrs = []
                for name in role_names:
                    if name not in r:
                        addrs.append(0)
                        continue
                    t = r[name][i]
                    if not t.is_contiguous() or t.data_ptr() % 16 != 0:
                        buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                        staged.append((g, name, i, buf, name in written))
                        t = buf
                    addrs.append(t.data_ptr())
                x = r[role_names[0]][i]
                rowlen = x.numel() // x.shape[0] if (scale_role in r and x.dim() > 0) else 1
                _check_rowlen(rowlen, tuple(x.shape))
                rows_meta.append(addrs + [x.numel(), rowlen])
                numels.append(x.numel())
            launches.append(
                _launch_of(
                    rows_meta,
                    numels,
                    nr,
                    present,
                    sig,
                    role_names,
                    device,
                    interp,
                    list(range(first, len(sources))),
                    row=int(rows_of[g]),
                )
            )
    n_slots = 0
    partials = None
    if norm:
        for lau in launches:
            lau.norm_programs = min(lau.n_tiles, MAX_NORM_PROGRAMS)
            lau.slot_base = n_slots
            n_slots += lau.norm_programs
        partials = torch.zeros(max(1, n_slots), dtype=torch.float64, device=device)
    return LaunchPlan(
        launches=launches,
        partials=partials,
        n_slots=n_slots,
        staged=staged,
        role_names=role_names,
        sources=sources,
        device=device,
    )


def _build_batched(roles, rows_of, fresh, C, hp_rows, role_names, written, device, norm, scale_role) -> LaunchPlan:
    """Virtual tensors: client ``c``'s slice of stacked tensor ``i`` of row group ``g`` is one table row
    (its address ``base + c * stride(0)``, hp row ``rows_of[g] * C + c``, client ``c``). Rows are
    grouped into launches by (roles present, dtypes, alignment, FRESH), client-major inside each
    launch, so a client's chunks are contiguous there (its norm slots form one range per launch).

    Client slices are not staged for alignment (a [C, 10] bias has every other slice 8 bytes off):
    misaligned rows go to a launch that makes no 128-bit promise. Only stacked tensors whose
    client slices are not contiguous are staged, whole."""
    interp = interpreted()
    nr = len(role_names) + 4
    staged: List[Tuple[int, str, int, torch.Tensor, bool]] = []
    entries = []
    sources: List[Tuple[int, int]] = []  # (row group, index) of each entry
    for g, r in enumerate(roles):
        present = tuple(name for name in role_names if name in r)
        for i, x in enumerate(r[role_names[0]]):
            per = x.numel() // C if C else 0
            if per == 0:
                continue
            sig = tuple(tl_dtype(r[name][i], name) for name in present)
            base, step = [], []
            for name in role_names:
                if name not in r:
                    base.append(0)
                    step.append(0)
                    continue
                t = r[name][i]
                if not t[0].is_contiguous():
                    buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                    staged.append((g, name, i, buf, name in written))
                    t = buf
                base.append(t.data_ptr())
                step.append(t.stride(0) * t.element_size())
            rowlen = per // x.shape[1] if (scale_role in r and x.dim() > 1) else 1
            _check_rowlen(rowlen, tuple(x.shape[1:]))
            # roles whose 16-byte alignment the kernels may promise (never the per-row scale)
            checked = [j for j, name in enumerate(role_names) if name in r and name != scale_role]
            entries.append((int(rows_of[g]), present, sig, base, step, checked, per, rowlen, int(bool(fresh[g]))))
            sources.append((g, i))
    # the interpreter's 2-D tiles make no alignment promise: no reason to launch apart
    split_aligned = not interp or FORCE_TILE is not None
    groups: OrderedDict[tuple, Tuple[list, list, list, list]] = OrderedDict()
    for c in range(C):
        for e, (row, present, sig, base, step, checked, per, rowlen, fr) in enumerate(entries):
            addrs = [b + c * s for b, s in zip(base, step, strict=True)]
            aligned = not split_aligned or all(addrs[j] % 16 == 0 for j in checked)
            rows_meta, numels, clients, srcs = groups.setdefault((present, sig, aligned, fr), ([], [], [], []))
            rows_meta.append(addrs + [row * C + c, c, per, rowlen])
            numels.append(per)
            clients.append(c)
            srcs.append(e)
    launches: List[Launch] = []
    seg = []
    n_slots = 0
    for (present, sig, aligned, fr), (rows_meta, numels, clients, srcs) in groups.items():
        lau = _launch_of(
            rows_meta,
            numels,
            nr,
            present,
            sig,
            role_names,
            device,
            interp,
            srcs,
            clients,
            row=0,
            batched=True,
            aligned=aligned,
            fresh=fr,
        )
        launches.append(lau)
        if norm:
            lau.norm_programs = lau.n_tiles
            lau.slot_base = n_slots
            counts = (np.asarray(numels, dtype=np.int64) + lau.block - 1) // lau.block
            per_client = np.zeros(C + 1, dtype=np.int64)
            np.add.at(per_client, np.asarray(clients, dtype=np.int64) + 1, counts)
            seg.append(n_slots + np.cumsum(per_client))  # seg[c]: first slot of client c
            n_slots += lau.n_chunks
    plan = LaunchPlan(
        launches=launches,
        partials=None,
        n_slots=n_slots,
        staged=staged,
        clients=C,
        hp_rows=hp_rows,
        role_names=role_names,
        sources=sources,
        device=device,
    )
    if norm:
        if n_slots >= 2**31:
            raise ValueError(f"the triton backend's batched norm supports fewer than 2**31 chunks, got {n_slots}")
        table = np.stack(seg) if seg else np.zeros((1, C + 1), dtype=np.int64)
        plan.seg = _to_device(torch.from_numpy(table.astype(np.int32)), device)
        plan.partials = torch.zeros(max(1, n_slots), dtype=torch.float64, device=device)
        plan.factors = torch.zeros(max(1, hp_rows * C), dtype=torch.float32, device=device)
    return plan
