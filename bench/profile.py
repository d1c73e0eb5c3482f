"""``python -m bench profile`` (or ``python -m bench loop --profile``): where a training iteration's time goes.

For each row of ``python -m bench loop`` (same models, optimizers and iteration), after warm-up,
a few iterations run under ``torch.profiler`` (CPU and, on a GPU, CUDA activity), each phase in a
``record_function`` range. Per row, one line of a table:

* host time per iteration (wall time of the iterations as the host spends it, the profiler's own
  cost included), split into zero_grad, forward (model and loss), backward and step;
* what the step calls, per step: device synchronisations (``cuda*Synchronize``), event records and
  waits, memory copies, allocations on the step's device (ops that allocated memory themselves, from
  the profiler's memory accounting), CUDA graph launches and kernel launches;
* GPU idle time per iteration: the profiled window minus the time any kernel or copy ran, and the
  longest gap between two of them;
* without the profiler: the step's host time inside the iteration (``step()`` timed alone in
  ``--iterations`` more iterations), its host time alone (the gradients in place, nothing around
  it), and their ratio: what the rest of the iteration costs the step (the goal: within 10%).

On a CPU it runs as a dry run of the same machinery (no CUDA activity, nothing replays).
"""

from __future__ import annotations

import bisect
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.autograd import profiler as _autograd_profiler

from . import cli
from .loop_rows import BATCH, MODELS, Row, fused_backends, make_row, optimizers, selected
from .machine import run_meta
from .report import publish
from .stopping import sigterm_interrupts
from .timing import error_text, host_call, median, sync, time_block

PHASES = ("zero_grad", "forward", "backward", "step")
# what the step calls, by the names of the CUDA runtime / driver calls the profiler records
CALLS = {
    "syncs": ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"),
    "event records": ("cudaEventRecord", "cudaEventRecordWithFlags"),
    "event waits": ("cudaStreamWaitEvent",),
    "memcpys": ("cudaMemcpy", "cudaMemcpyAsync", "cudaMemsetAsync", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync"),
    "graph launches": ("cudaGraphLaunch", "cuGraphLaunch"),
    "kernel launches": ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"),
}
COLUMNS = ("syncs", "event records", "event waits", "memcpys", "allocations", "graph launches", "kernel launches")


def profiled_iteration(row: Row) -> None:
    rf = _autograd_profiler.record_function
    with rf("loop.zero_grad"):
        row.opt.zero_grad(set_to_none=True)
    with rf("loop.forward"):
        loss = nn.functional.cross_entropy(row.model(row.x), row.y)
    with rf("loop.backward"):
        loss.backward()
    with rf("loop.step"):
        row.opt.step()


def _start(e: Any) -> float:
    return float(e.time_range.start)


def _end(e: Any) -> float:
    return float(e.time_range.end)


def _is_device(e: Any) -> bool:
    return getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA


def _self_bytes(e: Any, cuda: bool) -> int:
    """Bytes an op allocated itself (not its children) on the step's device."""
    names = ("self_device_memory_usage", "self_cuda_memory_usage") if cuda else ("self_cpu_memory_usage",)
    for attr in names:
        v = getattr(e, attr, None)
        if v is not None:
            return int(v)
    return 0


class _Ranges:
    """The profiled instances of one phase: sorted [start, end) host intervals."""

    def __init__(self, events: List[Any]):
        spans = sorted((_start(e), _end(e)) for e in events)
        self.starts = [s for s, _ in spans]
        self.spans = spans

    def total(self) -> float:
        return sum(e - s for s, e in self.spans)

    def holds(self, t: float) -> bool:
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and self.spans[i][0] <= t < self.spans[i][1]


def gpu_idle(events: List[Any], window: Tuple[float, float]) -> Tuple[float, float]:
    """(idle microseconds in ``window``, longest gap) between the device's kernels and copies."""
    spans = sorted((max(_start(e), window[0]), min(_end(e), window[1])) for e in events if _is_device(e))
    spans = [(s, e) for s, e in spans if e > s]
    if not spans:
        return window[1] - window[0], window[1] - window[0]
    idle, longest, cursor = 0.0, 0.0, window[0]
    for s, e in spans:
        if s > cursor:
            idle += s - cursor
            longest = max(longest, s - cursor)
        cursor = max(cursor, e)
    if window[1] > cursor:
        idle += window[1] - cursor
        longest = max(longest, window[1] - cursor)
    return idle, longest


def analyse(events: List[Any], iterations: int, cuda: bool) -> Dict[str, Any]:
    """The table line of one row from its profiled events (times in microseconds per iteration)."""
    phases = {p: _Ranges([e for e in events if e.name == f"loop.{p}"]) for p in PHASES}
    step = phases["step"]
    calls = {c: 0 for c in COLUMNS}
    for e in events:
        if _is_device(e) or not step.holds(_start(e)):
            continue
        for column, names in CALLS.items():
            if e.name in names:
                calls[column] += 1
        if _self_bytes(e, cuda) > 0:
            calls["allocations"] += 1
    out: Dict[str, Any] = {f"{p}_us": phases[p].total() / iterations for p in PHASES}
    out["calls_per_step"] = {c: n / iterations for c, n in calls.items()}
    starts = [s for r in phases.values() for s in r.starts]
    ends = [e for r in phases.values() for _, e in r.spans]
    if starts and cuda:
        idle, longest = gpu_idle(events, (min(starts), max(ends)))
        out["gpu_idle_us"] = idle / iterations
        out["gpu_longest_gap_us"] = longest
    return out


def step_in_loop_us(row: Row, iterations: int) -> float:
    """Median host time of ``step()`` inside whole iterations (nothing waits for the device)."""
    times = []
    for _ in range(iterations):
        row.opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(row.model(row.x), row.y).backward()
        times.append(host_call(row.opt.step))
    return 1e6 * median(times)


def step_alone_us(row: Row, device: torch.device, reps: int = 50) -> float:
    """Median host time of ``step()`` with the gradients in place (no forward/backward around it)."""
    row.iteration()
    sync(device)
    times = []
    for _ in range(reps):
        times.append(host_call(row.opt.step))
        sync(device)
    return 1e6 * median(times)


def profile_row(row: Row, device: torch.device, warmup: int, iterations: int) -> Dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        row.iteration()
    sync(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, profile_memory=True, record_shapes=False) as prof:
        seconds = time_block(lambda: profiled_iteration(row), device, iterations)
    out = analyse(list(prof.events()), iterations, cuda)
    out["iteration_us"] = 1e6 * seconds
    stats = getattr(row.opt, "replay_stats", None)
    out["replay"] = stats() if stats is not None else None
    out["step_in_loop_us"] = in_loop = step_in_loop_us(row, max(iterations, 10))
    sync(device)
    out["step_alone_us"] = alone = step_alone_us(row, device)
    out["step_in_loop_over_alone"] = in_loop / alone if alone > 0 else None
    return out


def markdown(result: Dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        f"# Where a training iteration's time goes: {m['device_name']}"
        + (" (**interrupted**)" if m.get("interrupted") else ""),
        "",
        f"- {m['date']}, commit `{m['commit']}`, torch {m['torch']}; `{m['command']}`",
        f"- {m['iterations']} iterations per row under torch.profiler (CPU{' and CUDA' if m['cuda'] else ''} "
        f"activity, memory events) after {m['warmup']} warm-up; batch {BATCH}; host times in us per "
        f"iteration, the profiler's own cost included; step calls per step",
        "",
        "| model | optimizer | iteration | zero_grad | forward | backward | step | step in loop "
        "(unprofiled) | step alone | in loop / alone | syncs | event rec. / waits | memcpys | allocations | "
        "graph launches | kernel launches | GPU idle / iteration (longest gap) | steps replayed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['optimizer']} | error: {r['error']} |" + " |" * 15)
            continue
        c = r["calls_per_step"]
        rep = r.get("replay")
        replayed = "—" if rep is None else f"{rep['replayed']}/{rep['eager'] + rep['recorded'] + rep['replayed']}"
        idle = "n/a" if "gpu_idle_us" not in r else f"{r['gpu_idle_us']:.0f} ({r['gpu_longest_gap_us']:.0f})"
        ratio = r.get("step_in_loop_over_alone")
        lines.append(
            f"| {r['model']} | {r['optimizer']} | {r['iteration_us']:.0f} | {r['zero_grad_us']:.1f} | "
            f"{r['forward_us']:.0f} | {r['backward_us']:.0f} | {r['step_us']:.1f} | {r['step_in_loop_us']:.1f} | "
            f"{r['step_alone_us']:.1f} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'} | {c['syncs']:g} | {c['event records']:g} / "
            f"{c['event waits']:g} | {c['memcpys']:g} | {c['allocations']:g} | {c['graph launches']:g} | "
            f"{c['kernel launches']:g} | {idle} | {replayed} |"
        )
    lines += [
        "",
        "in loop / alone: the step's host time inside iterations (no profiler) over its host time with "
        "the gradients in place and nothing around it (1.00: the rest of the loop costs the step nothing).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[2:] if argv is None else argv)
    ap = cli.parser("profile", __doc__)
    cli.add_device(ap, "cuda", help="cuda (default), or cpu: a dry run of the machinery")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--rows", nargs="+", help="only the rows whose names start with one of these")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iterations", type=int, default=5)
    cli.add_output(ap)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        cli.log("bench profile: torch sees no CUDA device (--device cpu runs it as a dry run)")
        return 2
    if args.iterations < 1 or args.warmup < 0:
        cli.log("bench profile: --iterations must be >= 1, --warmup >= 0")
        return 2
    makers = selected(optimizers(fused_backends(device)), args.rows)
    meta = run_meta(device, cli.command_line("profile", argv))
    meta.update(warmup=args.warmup, iterations=args.iterations, cuda=device.type == "cuda")
    rows: List[Dict[str, Any]] = []
    try:
        with sigterm_interrupts():  # stopped (Ctrl-C, gpu_check's deadline, kill): the rows done are kept
            for model_name in args.models:
                for name, make in makers.items():
                    try:
                        row = make_row(model_name, name, make, device)
                        res = profile_row(row, device, args.warmup, args.iterations)
                    except Exception as exc:  # a failing optimizer is a result, not a crash
                        res = {"error": error_text(exc, 200)}
                    res.update(model=model_name, optimizer=name)
                    rows.append(res)
                    cli.log(
                        f"  {model_name:<10} {name:<26} "
                        + (f"step {res['step_us']:.1f} us" if "step_us" in res else res["error"])
                    )
    except KeyboardInterrupt:
        meta["interrupted"] = True
        cli.log("bench profile: interrupted; writing the rows profiled so far")
    result = {"meta": meta, "rows": rows}
    publish(result, cli.out_dir(args), f"profile-{meta['device_slug']}-{meta['date']}", markdown, latest=False)
    return 0
