"""Timing for every benchmark: device sync, warm-up, blocks timed in a rotated order, medians, and
the disturbance check (other processes' CPU use, ``bench.contention``).

CPU times are host wall clock. CUDA times come from events recorded on the current stream around
each call (``time_calls``), or from the wall clock of a whole block with the device waited for at
its start and end (``time_block``), so a step whose host overhead exceeds its GPU work is timed at
its host rate, which is what a training loop sees.

Every benchmark that compares cases times them interleaved, in rounds, each round in a rotated
order (``rotated``), so that whatever load the machine is under falls on all of them alike:

- ``time_interleaved``: several cases, one short block of each per round, until every case has
  enough undisturbed blocks; a stall of another process only ever adds time, so a block whose
  median is well above the fastest block's was disturbed and is dropped (the step benchmark's
  rows, the parts and layers of the client-batched one; docs/benchmarks.md). ``time_settled`` is
  the same for one case.
- ``time_rounds``: a fixed number of rounds, each one block of every case, with the cores other
  processes used during each block (whole FL rounds, a training loop's iterations, operators).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

import torch

from .contention import DISTURBED, OtherLoad


@dataclass(frozen=True)
class Budget:
    """How long to time one case: ``warmup`` untimed calls, then at least ``min_reps`` timed calls
    and ``min_time_s`` seconds, at most ``max_reps`` calls."""

    warmup: int = 3
    min_reps: int = 10
    max_reps: int = 300
    min_time_s: float = 1.0


T = TypeVar("T")


def sync(device: torch.device) -> None:
    """Wait until ``device`` has run the work queued on it (a CPU runs it as it is called)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: Sequence[float]) -> float:
    """The median of ``xs``; NaN when there is none (a case that timed nothing)."""
    return statistics.median(xs) if len(xs) else float("nan")


def error_text(exc: BaseException, limit: int = 300) -> str:
    """A failed case's result: the exception's type and the first line of its message."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:limit]


def rotated(items: Sequence[T], r: int) -> List[T]:
    """Round ``r``'s order: from item ``r`` on, forwards in even rounds and backwards in odd ones (each
    item comes first once in ``len(items)`` rounds, and follows each neighbour in both directions)."""
    n = len(items)
    step = 1 if r % 2 == 0 else -1
    return [items[(r + step * i) % n] for i in range(n)]


class Stopwatch:
    """Wall seconds since it was made: how long a run or a phase took (its header, its log), not a timing."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def host_call(fn: Callable[[], object]) -> float:
    """Host seconds of one call of ``fn``, without waiting for the device: what a loop pays on the CPU."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_block(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``fn`` in one stretch, the device waited for at its start and end."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls


def time_calls(fn: Callable[[], object], device: torch.device, budget: Budget) -> List[float]:
    """Seconds per call of ``fn`` for each timed call (median it: the first calls can be outliers)."""
    for _ in range(budget.warmup):
        fn()
    sync(device)
    times: List[float] = []
    t_start = time.perf_counter()
    if device.type == "cuda":
        pending: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        while len(pending) < budget.max_reps:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            pending.append((a, b))
            if len(pending) >= budget.min_reps and len(pending) % 8 == 0:
                b.synchronize()  # only to know the elapsed wall time; between timed regions
                if time.perf_counter() - t_start >= budget.min_time_s:
                    break
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) / 1e3 for a, b in pending]
    else:
        while len(times) < budget.max_reps:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            if len(times) >= budget.min_reps and time.perf_counter() - t_start >= budget.min_time_s:
                break
    return times


# time_interleaved: blocks (rounds) timed at first and at most, and how much slower than the fastest
# block's median a block may be and still count as undisturbed
BLOCKS = 3
MAX_BLOCKS = 6
AGREE = 1.5


@dataclass
class Timed:
    """One case's result from ``time_interleaved``: seconds per call of its kept blocks, the cores
    other processes used while those blocks ran (None where unmeasurable), or the error it raised."""

    times: List[float] = field(default_factory=list)
    other_load: Optional[float] = None
    error: Optional[str] = None
    exc: Optional[Exception] = field(default=None, repr=False)


def _failed(res: Timed, exc: Exception) -> None:
    res.error = error_text(exc)
    res.exc = exc


@dataclass
class _Blocks:
    times: List[List[float]] = field(default_factory=list)
    loads: List[Optional[float]] = field(default_factory=list)  # cores, per block
    walls: List[float] = field(default_factory=list)  # seconds, per block

    def median(self, i: int) -> float:
        return statistics.median(self.times[i])


def _per_block(budget: Budget, blocks: int) -> Budget:
    per_max = max(1, budget.max_reps // blocks)
    return Budget(
        warmup=0,
        min_reps=min(per_max, -(-budget.min_reps // blocks)),
        max_reps=per_max,
        min_time_s=budget.min_time_s / blocks,
    )


def _undisturbed(b: _Blocks, device: torch.device, agree: float) -> List[int]:
    """A case's blocks that no disturbance slowed: as fast as its fastest and, on a CPU, quiet."""
    medians = [b.median(i) for i in range(len(b.times))]
    fast = [m <= agree * min(medians) for m in medians]
    loaded = [device.type == "cpu" and c is not None and c > DISTURBED for c in b.loads]
    return [i for i in range(len(b.times)) if fast[i] and not loaded[i]]


def _load_of(b: _Blocks, chosen: List[int]) -> Optional[float]:
    """Cores other processes used over the chosen blocks together (weighted by their wall time)."""
    pairs = [(c, b.walls[i]) for i in chosen if (c := b.loads[i]) is not None]
    if not pairs:
        return None
    wall = sum(w for _, w in pairs)
    return sum(c * w for c, w in pairs) / wall if wall > 0 else max(c for c, _ in pairs)


def time_interleaved(
    fns: Sequence[Callable[[], object]],
    device: torch.device,
    budget: Budget,
    blocks: int = BLOCKS,
    max_blocks: int = MAX_BLOCKS,
    agree: float = AGREE,
) -> List[Timed]:
    """Seconds per call of each of ``fns``, each with the budget ``time_calls`` would give it alone,
    timed in rounds: each round times one block of every case, the cases in a rotated order (none
    always first, none always after the same neighbour), so that load on the machine falls on all of
    them alike. A block is disturbed when its median exceeds ``agree`` x the fastest block's of its
    case or, on a CPU, when other processes kept more than ``DISTURBED`` cores busy while it ran;
    rounds go on until every case has ``blocks`` undisturbed blocks, ``max_blocks`` rounds at most.
    A case keeps its undisturbed blocks (when none is: those as fast as its fastest), topped up with
    its next fastest blocks to at least ``budget.min_reps`` calls. A case that raises is left out of
    later rounds and returns its error.

    One stalled call cannot move a median, but a stall of a few hundred milliseconds can fill a
    whole short timing loop: a multi-threaded kernel waits for its descheduled thread on every
    call. A disturbance longer than every block stays in the figures, and the runner flags the row."""
    per = _per_block(budget, blocks)
    out = [Timed() for _ in fns]
    for i, fn in enumerate(fns):
        try:
            for _ in range(budget.warmup):
                fn()
        except Exception as exc:  # a case that fails is a result too
            _failed(out[i], exc)
    timed = [_Blocks() for _ in fns]
    for r in range(max_blocks):
        live = [i for i in range(len(fns)) if out[i].error is None]
        if not live or (r >= blocks and all(len(_undisturbed(timed[i], device, agree)) >= blocks for i in live)):
            break
        for i in rotated(live, r):  # none always first, none always after the same neighbour
            with OtherLoad() as others:
                t0 = time.perf_counter()
                try:
                    calls = time_calls(fns[i], device, per)
                except Exception as exc:
                    _failed(out[i], exc)
                    continue
                wall = time.perf_counter() - t0
            timed[i].times.append(calls)
            timed[i].walls.append(wall)
            timed[i].loads.append(others.cores)
    for i, b in enumerate(timed):
        if out[i].error is not None or not b.times:
            continue
        chosen = _undisturbed(b, device, agree)
        if not chosen:
            medians = [b.median(j) for j in range(len(b.times))]
            chosen = [j for j in range(len(b.times)) if medians[j] <= agree * min(medians)]
        for j in sorted(range(len(b.times)), key=b.median):
            if sum(len(b.times[k]) for k in chosen) >= budget.min_reps:
                break
            if j not in chosen:
                chosen.append(j)
        out[i].times = [x for j in chosen for x in b.times[j]]
        out[i].other_load = _load_of(b, chosen)
    return out


def time_settled(
    fn: Callable[[], object],
    device: torch.device,
    budget: Budget,
    blocks: int = BLOCKS,
    max_blocks: int = MAX_BLOCKS,
    agree: float = AGREE,
) -> List[float]:
    """Seconds per call of ``fn`` alone, timed as ``time_interleaved`` times each of several cases."""
    (res,) = time_interleaved([fn], device, budget, blocks, max_blocks, agree)
    if res.exc is not None:
        raise res.exc
    return res.times


@dataclass
class Rounds:
    """One case's result from ``time_rounds``: per round, the seconds per call of its block and the
    cores other processes used meanwhile (None where unmeasurable); or the error it raised, after
    which it sat out the later rounds."""

    times: List[float] = field(default_factory=list)
    loads: List[Optional[float]] = field(default_factory=list)
    error: Optional[str] = None

    def worst_load(self) -> Optional[float]:
        """The most cores other processes used during one of its blocks (None: never measured)."""
        loads = [c for c in self.loads if c is not None]
        return max(loads) if loads else None


def time_round(
    fns: Mapping[str, Callable[[], object]],
    device: torch.device,
    r: int,
    out: Dict[str, Rounds],
    calls: int = 1,
    untimed: int = 0,
    around: Optional[Callable[[str], ContextManager[object]]] = None,
) -> None:
    """Round ``r`` of ``time_rounds``, added to ``out``."""
    for name in rotated([n for n in fns if out[n].error is None], r):
        try:
            for _ in range(untimed):
                fns[name]()
            with around(name) if around is not None else contextlib.nullcontext(), OtherLoad() as others:
                seconds = time_block(fns[name], device, calls)
        except Exception as exc:  # a case that fails is a result too
            out[name].error = error_text(exc)
            continue
        out[name].times.append(seconds)
        out[name].loads.append(others.cores)


def time_rounds(
    fns: Mapping[str, Callable[[], object]],
    device: torch.device,
    rounds: int,
    calls: int = 1,
    untimed: int = 0,
    around: Optional[Callable[[str], ContextManager[object]]] = None,
) -> Dict[str, Rounds]:
    """Each of ``rounds`` rounds times one block of every case in a rotated order (``rotated``): ``untimed``
    calls, then ``calls`` timed ones (``time_block``), inside ``around(name)`` when given (what a case
    counts during its timed calls). Warm-up comes first, from the caller: every block is kept."""
    out = {name: Rounds() for name in fns}
    for r in range(rounds):
        time_round(fns, device, r, out, calls, untimed, around)
    return out


def host_time(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Median host seconds of one call, without waiting for the device: what a training loop pays on
    the CPU per step (on a CPU it is the step time; on a GPU the launch overhead, when the GPU keeps up)."""
    fn()
    sync(device)
    times = [host_call(fn) for _ in range(reps)]
    sync(device)
    return median(times)


def time_graph(
    fn: Callable[[], object],
    device: torch.device,
    steps: int,
    budget: Budget,
    before_capture: Optional[Callable[[int], None]] = None,
) -> float:
    """Median seconds per call when ``steps`` calls are captured in one CUDA graph and replayed.

    Warm-up runs on a side stream as torch's CUDA-graph notes require. ``before_capture(steps)``
    may prepare host-side caches (e.g. extend a schedule table) so that capture allocates nothing
    from the host.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    if before_capture is not None:
        before_capture(steps)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    times = time_calls(graph.replay, device, budget)
    del graph
    return median(times) / steps


def copy_bandwidth(nbytes: int, device: torch.device, budget: Budget) -> float:
    """Bytes/s of ``dst.copy_(src)`` moving ``nbytes`` in total (half read, half written).

    The copy moves the same traffic as the step it is compared with, so both see the same cache
    behaviour; callers measure it right next to that step, under the same machine load.
    """
    n = max(1, nbytes // 8)  # float32 elements: n*4 read + n*4 written = nbytes
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = time_settled(lambda: dst.copy_(src), device, budget)
    return 8 * n / median(times)
