"""Run the benchmark matrix (algorithm x backend x size) and derive every figure of a row."""

from __future__ import annotations

import dataclasses
import functools
import gc
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

import fedopt_kernels as fk

from .algorithms import ALGOS, EAGER, REPLAYING, TORCH_FOREACH, TORCH_FUSED, Stepper, build_baseline, eager_name
from .contention import DISTURBED, wait_quiet
from .memory import state_bytes, step_peak_bytes
from .shapes import SIZES, total_numel
from .stopping import sigterm_interrupts
from .timing import (
    Budget,
    Stopwatch,
    Timed,
    copy_bandwidth,
    error_text,
    host_call,
    host_time,
    median,
    sync,
    time_graph,
    time_interleaved,
)
from .traffic import bytes_per_element, bytes_per_step

Row = Dict[str, Any]


@dataclass
class Plan:
    device: torch.device
    sizes: List[str]
    algos: List[str]
    dtype: torch.dtype = torch.float32
    backends: Optional[List[str]] = None  # None: every backend available on the device
    budget: Budget = field(default_factory=Budget)
    graph_steps: int = 10  # steps captured per CUDA graph (0: no graph timing)
    baselines: bool = True  # time torch.optim.SGD fused/foreach where comparable
    eager_rows: bool = True  # on CUDA: also each replaying backend with replay=False
    retries: int = 0  # CPU: time a group disturbed by other processes again this often
    quiet_wait_s: float = 60.0  # ... after waiting at most this long for idle cores
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)


def select_backends(plan: Plan) -> tuple[List[str], Dict[str, str]]:
    """Backends to time on ``plan.device`` and why each other one is left out."""
    avail = fk.available_backends(plan.device)
    skipped = dict(avail.missing)
    chosen = []
    for name in avail:
        if plan.backends is not None and name not in plan.backends:
            skipped[name] = "not requested"
        elif name == "triton" and plan.device.type != "cuda":
            # on CPU tensors triton runs only under TRITON_INTERPRET, whose speed means nothing
            skipped[name] = "triton is timed on CUDA tensors only (TRITON_INTERPRET timings are meaningless)"
        else:
            chosen.append(name)
    return chosen, skipped


def _make_params(shapes, dtype: torch.dtype, device: torch.device, seed: int = 0) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = (torch.randn(shape, generator=gen) * 0.1).to(device=device, dtype=dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=gen) * 0.01).to(device=device, dtype=dtype)
        params.append(p)
    return params


def _prepare_capture(stepper: Stepper, steps: int) -> None:
    """Grow FedDecaySGD's schedule table on the device so capture never copies from the host."""
    opt = stepper.opt
    sched = getattr(opt, "schedule", None)
    if sched is not None and hasattr(sched, "table"):
        dev = opt.param_groups[0]["params"][0].device
        sched.table(dev, getattr(opt, "round_step", 0) + 2 * steps + 2)


def record_host_time(build: Callable[[], Stepper], device: torch.device, tries: int = 3) -> Optional[float]:
    """Median host seconds of the step that records a CUDA graph (docs/replay.md), in a fresh
    optimizer's first steps; None for an optimizer that does not replay or records nothing."""
    times = []
    for _ in range(tries):
        stepper = build()
        stats = getattr(stepper.opt, "replay_stats", None)
        if stats is None or not stats()["on"]:
            return None
        for _ in range(4):  # eager steps (a fresh-momentum step, a new plan), then the recording
            sync(device)
            before = stats()["recorded"]
            t = host_call(stepper.step)
            if stats()["recorded"] > before:
                times.append(t)
                break
        sync(device)
        del stepper
    return median(times) if times else None


@dataclass
class Case:
    """One row to time: how to build its stepper, whether to time it replayed from a CUDA graph, and
    the bytes its copy roofline moves (None: no roofline)."""

    build: Callable[[], Stepper]
    graph: bool
    nbytes: Optional[int]


def _prepare(case: Case, plan: Plan, out: Row) -> Optional[Stepper]:
    """Build and warm a case's stepper and take its memory figures (and, on CUDA, the host time of
    the step that records a graph); None, with ``out["error"]`` set, when the case fails."""
    try:
        if plan.device.type == "cuda":
            out["record_host_s"] = record_host_time(case.build, plan.device)
        stepper = case.build()
        for _ in range(plan.budget.warmup):
            stepper.step()
        # after warm-up all state exists, so this is what a step allocates on top of it
        out["step_extra_bytes"] = step_peak_bytes(stepper.step, plan.device)
        out["state_bytes"] = state_bytes(stepper.opt)
        return stepper
    except Exception as exc:  # a backend that fails is a result too, not a crash
        out["error"] = error_text(exc)
        return None


def _copies(sizes: List[int], device: torch.device) -> Dict[int, Callable[[], object]]:
    """Per byte count, ``dst.copy_(src)`` moving that many bytes in total (half read, half written):
    the roofline of a step that moves the same bytes, with the same cache behaviour. The copies are
    prefixes of one pair of buffers, so a group holds one copy's memory, the largest."""
    if not sizes:
        return {}
    elements = {b: max(1, b // 8) for b in sizes}  # float32: n*4 read + n*4 written = nbytes
    src = torch.randn(max(elements.values()), device=device)
    dst = torch.empty_like(src)
    return {b: functools.partial(_copy_prefix, dst, src, n) for b, n in elements.items()}


def _copy_prefix(dst: torch.Tensor, src: torch.Tensor, n: int) -> torch.Tensor:
    return dst[:n].copy_(src[:n])


def _time_together(steppers: Dict[int, Stepper], cases: List[Case], plan: Plan, outs: List[Row]) -> None:
    """Time every live stepper and the copy rooflines of their byte counts interleaved, round by
    round (``timing.time_interleaved``): a ratio between two rows of the group, or between a row and
    its roofline, is a ratio of medians taken under the same load."""
    fns: List[Callable[[], object]] = []
    owner: List[Any] = []  # a case index, or ("copy", nbytes)
    for i, stepper in steppers.items():
        fns.append(stepper.step)
        owner.append(i)
    sizes = [b for b in dict.fromkeys(cases[i].nbytes for i in steppers) if b is not None]
    for nbytes, copy in _copies(sizes, plan.device).items():
        fns.append(copy)
        owner.append(("copy", nbytes))
    budget = dataclasses.replace(plan.budget, warmup=1)
    copies: Dict[int, Timed] = {}
    for who, res in zip(owner, time_interleaved(fns, plan.device, budget)):
        if isinstance(who, tuple):
            copies[who[1]] = res
            continue
        out = outs[who]
        if res.error is not None:
            out["error"] = res.error
            continue
        out.update(median_s=median(res.times), min_s=min(res.times), reps=len(res.times))
        out["other_load_cores"] = res.other_load
    for i in steppers:
        moved = cases[i].nbytes
        if moved is None or "error" in outs[i]:
            continue
        res = copies[moved]
        if res.error is not None or not res.times:
            outs[i]["error"] = f"copy roofline: {res.error}"
            continue
        outs[i]["copy_gbps"] = 8 * max(1, moved // 8) / median(res.times) / 1e9
        outs[i]["copy_other_load_cores"] = res.other_load


def _worst_load(outs: List[Row]) -> float:
    return max(
        (o.get(k) or 0.0 for o in outs if "error" not in o for k in ("other_load_cores", "copy_other_load_cores")),
        default=0.0,
    )


def measure_group(cases: List[Case], plan: Plan) -> List[Row]:
    """Measure the cases of one algorithm and size together: each is built and warmed up, then all
    are timed interleaved with their copy rooflines, then (CUDA) each one's host time and graph
    replay. On a CPU, a group that other processes disturbed is timed again, up to
    ``plan.retries`` times after waiting for idle cores, and the least disturbed attempt is kept."""
    outs: List[Row] = [{} for _ in cases]
    steppers: Dict[int, Stepper] = {}
    for i, case in enumerate(cases):
        stepper = _prepare(case, plan, outs[i])
        if stepper is not None:
            steppers[i] = stepper
    best: Optional[List[Row]] = None
    attempts = 1 + (plan.retries if plan.device.type == "cpu" else 0)
    for attempt in range(attempts):
        if attempt:
            wait_quiet(plan.quiet_wait_s)
        tried = [dict(o) for o in outs]
        _time_together(steppers, cases, plan, tried)
        gc.collect()
        if best is None or _worst_load(tried) < _worst_load(best):
            best = tried
        for o in best:
            o["attempts"] = attempt + 1
        if _worst_load(tried) <= DISTURBED:
            break
    assert best is not None  # the first attempt always sets it
    for i, stepper in steppers.items():
        out = best[i]
        if "error" in out:
            continue
        if plan.device.type != "cuda":
            out["host_s"] = out["median_s"]
            continue
        try:
            out["host_s"] = host_time(stepper.step, plan.device)
            if cases[i].graph and plan.graph_steps > 0:
                try:
                    out["graph_median_s"] = time_graph(
                        stepper.step,
                        plan.device,
                        plan.graph_steps,
                        plan.budget,
                        before_capture=functools.partial(_prepare_capture, stepper),
                    )
                except Exception as exc:  # report, do not abort the run
                    out["graph_error"] = error_text(exc)
        except Exception as exc:
            out["error"] = error_text(exc)
    steppers.clear()
    gc.collect()
    return best


def _measure(build: Callable[[], Stepper], plan: Plan, graph: bool) -> Row:
    """One case alone, without a copy roofline."""
    return measure_group([Case(build, graph, None)], plan)[0]


def _prime(plan: Plan, backends: List[str]) -> None:
    """Step every case once on two tiny tensors, so one-time costs (lazy initialisation, kernel
    compilation for the dtype) land in no case's time or peak memory."""
    params = _make_params([(4, 3), (4,)], plan.dtype, plan.device)
    for algo_name in plan.algos:
        for backend in backends:
            try:
                ALGOS[algo_name].build(params, backend).step()
            except Exception:
                pass  # the real case will record the error
    copy_bandwidth(64, plan.device, Budget(warmup=1, min_reps=1, max_reps=1, min_time_s=0.0))
    gc.collect()


def run(plan: Plan) -> Dict[str, Any]:
    """Time every case of ``plan``; return {"rows": [...], "backends": ..., "skipped": ...,
    "interrupted": stopped by SIGINT or SIGTERM before the last case}."""
    backends, skipped = select_backends(plan)
    _prime(plan, backends)
    rows: List[Row] = []
    try:
        with sigterm_interrupts():
            _time_cases(plan, backends, rows)
        interrupted = False
    except KeyboardInterrupt:
        # a deadline (bench/gpu_check.sh sends SIGINT), Ctrl-C or kill: keep and report the rows timed so far
        plan.log(f"bench: interrupted after {len(rows)} rows; writing those")
        interrupted = True
    _derive(rows, plan)
    return {"rows": rows, "backends": backends, "skipped": skipped, "interrupted": interrupted}


def _time_cases(plan: Plan, backends: List[str], rows: List[Row]) -> None:
    """Time every (size, algorithm, backend) case of ``plan``, the cases of one size and algorithm
    together (``measure_group``), appending each group's rows as it is done."""
    for size in plan.sizes:
        shapes = SIZES[size]
        params = _make_params(shapes, plan.dtype, plan.device)
        for algo_name in plan.algos:
            algo = ALGOS[algo_name]
            # the builders read algo and params late on purpose, called in this iteration only: bound as
            # defaults, the cases list would keep this size's params alive past `del params` below
            builds = [(b, (lambda b=b: algo.build(params, b))) for b in backends]  # noqa: B023, F821
            if plan.eager_rows and plan.device.type == "cuda":
                builds += [
                    (eager_name(b), (lambda b=b: algo.build(params, b, replay=False)))  # noqa: B023, F821
                    for b in backends
                    if b in REPLAYING
                ]
            if plan.baselines:
                builds += [(w, (lambda w=w: build_baseline(algo, params, w))) for w in algo.baselines()]  # noqa: B023, F821
            group: List[Row] = []
            cases: List[Case] = []
            for backend, build in builds:
                # torch.optim.SGD does the plain SGD work (no neuron scales, corrections or anchors);
                # a hand-written baseline does the algorithm's work, counted at its bytes (Baseline.traffic)
                traffic = algo.baseline_traffic(backend) if backend in algo.baseline_of else algo.traffic
                nbytes = bytes_per_step(traffic, shapes, plan.dtype)
                group.append(
                    dict(
                        algorithm=algo_name,
                        label=algo.label,
                        backend=backend,
                        size=size,
                        device_type=plan.device.type,
                        dtype=str(plan.dtype).replace("torch.", ""),
                        n_tensors=len(shapes),
                        numel=total_numel(shapes),
                        bytes_per_element=bytes_per_element(traffic, plan.dtype),
                        bytes_per_step=nbytes,
                    )
                )
                cases.append(Case(build, backend != "reference", nbytes))
            took = Stopwatch()
            for row, out in zip(group, measure_group(cases, plan)):
                row.update(out)
                rows.append(row)
                plan.log(
                    f"  {size:>9} {algo_name:<22} {row['backend']:<19} "
                    + (
                        f"{row['median_s'] * 1e3:9.3f} ms  ({row['reps']} reps)"
                        if "median_s" in row
                        else f"ERROR {row['error']}"
                    )
                )
            plan.log(f"  ({len(group)} cases timed together in {took.seconds():.1f}s)")
            gc.collect()
        del params
        gc.collect()


def _derive(rows: List[Row], plan: Plan) -> None:
    """GB/s, % of copy bandwidth, and speedups against reference and torch SGD, per row; and, per
    figure, how many cores other processes used while the row it is compared with was timed
    (``against_load``: the goals call a figure disturbed when either side was)."""
    index = {(r["algorithm"], r["backend"], r["size"]): r for r in rows}
    for r in rows:
        if "median_s" not in r:
            continue
        r["gbps"] = r["bytes_per_step"] / r["median_s"] / 1e9
        against: Dict[str, Optional[float]] = {}
        if "copy_gbps" in r:
            r["pct_copy"] = 100.0 * r["gbps"] / r["copy_gbps"]
            against["pct_copy"] = r.get("copy_other_load_cores")
        if "graph_median_s" in r:
            r["graph_gbps"] = r["bytes_per_step"] / r["graph_median_s"] / 1e9
        cuda = "cuda" + EAGER if r["backend"].endswith(EAGER) else "cuda"  # eager against eager
        hand = ALGOS[r["algorithm"]].by_hand if r["algorithm"] in ALGOS else None
        for col, other in (
            ("speedup_ref", "reference"),
            ("speedup_sgd_fused", TORCH_FUSED),
            ("speedup_sgd_foreach", TORCH_FOREACH),
            ("speedup_hand", hand),
            ("speedup_cuda", cuda),
        ):
            o = index.get((r["algorithm"], other, r["size"]))
            r[col] = o["median_s"] / r["median_s"] if o is not None and "median_s" in o else None
            if r[col] is not None:
                against[col] = o.get("other_load_cores") if o is not None else None
        # torch's fused SGD on the same list, whatever the algorithm: the step a user has today (the
        # row timed beside this one where the algorithm has it, else another algorithm's)
        sgd = index.get((r["algorithm"], TORCH_FUSED, r["size"]))
        if sgd is None or "median_s" not in sgd:
            sgd = next(
                (o for (a, b, z), o in index.items() if b == TORCH_FUSED and z == r["size"] and "median_s" in o), None
            )
        r["vs_torch_sgd_step"] = r["median_s"] / sgd["median_s"] if sgd is not None else None
        if sgd is not None:
            against["vs_torch_sgd_step"] = sgd.get("other_load_cores")
        r["against_load"] = against
