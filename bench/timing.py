"""Step timers: median wall time per call, CUDA-graph replay time, and copy bandwidth.

CPU times are host wall clock around each call. CUDA times come from events recorded on the
current stream around each call, so a step whose host overhead exceeds its GPU work is timed at
its host rate, which is what a training loop sees.

``time_settled`` times a case in a few short blocks and drops the blocks that a disturbance
slowed (docs/benchmarks.md): a stall of another process only ever adds time, so a block whose
median is well above the fastest block's was disturbed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: torch.device, budget: Budget) -> List[float]:
    """Seconds per call of ``fn`` for each timed call (median it: the first calls can be outliers)."""
    for _ in range(budget.warmup):
        fn()
    _sync(device)
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


# time_settled: blocks timed at first and at most, and how much slower than the fastest block's
# median a block may be and still count as undisturbed
BLOCKS = 3
MAX_BLOCKS = 6
AGREE = 1.5


def time_settled(
    fn: Callable[[], object],
    device: torch.device,
    budget: Budget,
    blocks: int = BLOCKS,
    max_blocks: int = MAX_BLOCKS,
    agree: float = AGREE,
) -> List[float]:
    """Seconds per call, like ``time_calls`` with the same budget in total, but timed in ``blocks``
    blocks. A block is disturbed when its median exceeds ``agree`` x the fastest block's or, on a
    CPU, when other processes kept more than ``DISTURBED`` cores busy while it ran; another block
    is timed for each disturbed one, up to ``max_blocks`` in all. Returns the undisturbed blocks'
    calls (when none is: those of the blocks as fast as the fastest), topped up with the next
    fastest blocks to at least ``budget.min_reps`` calls.

    One stalled call cannot move a median, but a stall of a few hundred milliseconds can fill a
    whole short timing loop: a multi-threaded kernel waits for its descheduled thread on every
    call. A disturbance longer than every block stays in the figures, and the runner flags the row."""
    per_max = max(1, budget.max_reps // blocks)
    per = Budget(
        warmup=0,
        min_reps=min(per_max, -(-budget.min_reps // blocks)),
        max_reps=per_max,
        min_time_s=budget.min_time_s / blocks,
    )
    for _ in range(budget.warmup):
        fn()
    timed: List[List[float]] = []
    loaded: List[bool] = []
    while True:
        with OtherLoad() as others:
            timed.append(time_calls(fn, device, per))
        loaded.append(device.type == "cpu" and others.cores is not None and others.cores > DISTURBED)
        medians = [statistics.median(b) for b in timed]
        fast = [m <= agree * min(medians) for m in medians]
        quiet = [i for i in range(len(timed)) if fast[i] and not loaded[i]]
        if len(quiet) >= blocks or len(timed) >= max_blocks:
            break
    chosen = quiet or [i for i in range(len(timed)) if fast[i]]
    for i in sorted(range(len(timed)), key=medians.__getitem__):
        if sum(len(timed[j]) for j in chosen) >= budget.min_reps:
            break
        if i not in chosen:
            chosen.append(i)
    return [t for i in chosen for t in timed[i]]


def host_time(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Median host seconds of one call, without waiting for the device: what a training loop pays on
    the CPU per step (on a CPU it is the step time; on a GPU the launch overhead, when the GPU keeps up)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _sync(device)
    return statistics.median(times)


def median(xs: List[float]) -> float:
    return statistics.median(xs)


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
