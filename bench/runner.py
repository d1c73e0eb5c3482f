"""Run the benchmark matrix (algorithm x backend x size) and derive every figure of a row."""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

import fedopt_kernels as fk

from .algorithms import ALGOS, EAGER, REPLAYING, TORCH_FOREACH, TORCH_FUSED, Stepper, build_baseline, eager_name
from .contention import DISTURBED, OtherLoad, wait_quiet
from .memory import state_bytes, step_peak_bytes
from .shapes import SIZES, total_numel
from .stopping import sigterm_interrupts
from .timing import Budget, copy_bandwidth, host_time, median, time_graph, time_settled
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
    retries: int = 0  # CPU: redo a case disturbed by other processes this often
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
            torch.cuda.synchronize(device)
            before = stats()["recorded"]
            t0 = time.perf_counter()
            stepper.step()
            t = time.perf_counter() - t0
            if stats()["recorded"] > before:
                times.append(t)
                break
        torch.cuda.synchronize(device)
        del stepper
    return median(times) if times else None


def _measure(build: Callable[[], Stepper], plan: Plan, graph: bool) -> Row:
    out: Row = {}
    if plan.device.type == "cuda":
        out["record_host_s"] = record_host_time(build, plan.device)
    stepper = build()
    for _ in range(plan.budget.warmup):
        stepper.step()
    # after warm-up all state exists, so this is what a step allocates on top of it
    out["step_extra_bytes"] = step_peak_bytes(stepper.step, plan.device)
    out["state_bytes"] = state_bytes(stepper.opt)
    times = time_settled(stepper.step, plan.device, dataclasses.replace(plan.budget, warmup=1))
    out.update(median_s=median(times), min_s=min(times), reps=len(times))
    out["host_s"] = host_time(stepper.step, plan.device) if plan.device.type == "cuda" else out["median_s"]
    if graph and plan.device.type == "cuda" and plan.graph_steps > 0:
        try:
            out["graph_median_s"] = time_graph(
                stepper.step,
                plan.device,
                plan.graph_steps,
                plan.budget,
                # read late on purpose (not bound as a default): `del stepper` below frees it
                before_capture=lambda k: _prepare_capture(stepper, k),  # noqa: F821
            )
        except Exception as exc:  # report, do not abort the run
            out["graph_error"] = f"{type(exc).__name__}: {exc}"
    del stepper
    return out


_MEASURED = (
    "median_s",
    "min_s",
    "reps",
    "host_s",
    "record_host_s",
    "step_extra_bytes",
    "state_bytes",
    "graph_median_s",
    "graph_error",
    "copy_gbps",
    "other_load_cores",
    "attempts",
    "error",
)


def _case(build: Callable[[], Stepper], plan: Plan, graph: bool, nbytes: int) -> Row:
    """Measure one case and the copy roofline next to it; on a CPU, redo a case that other
    processes disturbed (up to ``plan.retries`` times, after waiting for idle cores) and keep the
    least disturbed attempt."""
    best: Optional[Row] = None
    for attempt in range(1 + (plan.retries if plan.device.type == "cpu" else 0)):
        if attempt:
            wait_quiet(plan.quiet_wait_s)
        out: Row = {}
        with OtherLoad() as others:
            try:
                out.update(_measure(build, plan, graph))
                # the roofline, measured now: same load on the machine as the step just timed
                out["copy_gbps"] = copy_bandwidth(nbytes, plan.device, plan.budget) / 1e9
            except Exception as exc:  # a backend that fails is a result too, not a crash
                out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        out["other_load_cores"] = others.cores
        out["attempts"] = attempt + 1
        gc.collect()
        if best is None or (others.cores or 0.0) < (best["other_load_cores"] or 0.0):
            best = out
        if "error" in out or others.cores is None or others.cores <= DISTURBED:
            break
    assert best is not None  # the first attempt always sets it
    best["attempts"] = out["attempts"]
    return best


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
    """Time every (size, algorithm, backend) case of ``plan``, appending each row as it is done."""
    for size in plan.sizes:
        shapes = SIZES[size]
        params = _make_params(shapes, plan.dtype, plan.device)
        baseline_cache: Dict[tuple, Row] = {}
        for algo_name in plan.algos:
            algo = ALGOS[algo_name]
            # the builders read algo and params late on purpose, called in this iteration only: bound as
            # defaults, the cases list would keep this size's params alive past `del params` below
            cases = [(b, (lambda b=b: algo.build(params, b))) for b in backends]  # noqa: B023, F821
            if plan.eager_rows and plan.device.type == "cuda":
                cases += [
                    (eager_name(b), (lambda b=b: algo.build(params, b, replay=False)))  # noqa: B023, F821
                    for b in backends
                    if b in REPLAYING
                ]
            if plan.baselines:
                cases += [(w, (lambda w=w: build_baseline(algo, params, w))) for w in algo.baselines()]  # noqa: B023, F821
            for backend, build in cases:
                # torch.optim.SGD does the plain SGD work (no neuron scales, corrections or anchors);
                # a hand-written baseline does the algorithm's work, counted at its bytes (Baseline.traffic)
                baseline = backend in algo.baseline_of
                traffic = algo.baseline_traffic(backend) if baseline else algo.traffic
                nbytes = bytes_per_step(traffic, shapes, plan.dtype)
                row: Row = dict(
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
                key = (backend, nbytes, tuple(sorted(algo.baseline_kwargs(backend).items()))) if baseline else None
                t0 = time.perf_counter()
                if key is not None and key in baseline_cache:
                    row.update(baseline_cache[key])  # the same torch work, measured for another algorithm
                else:
                    row.update(_case(build, plan, backend != "reference", nbytes))
                    if key is not None:
                        baseline_cache[key] = {k: v for k, v in row.items() if k in _MEASURED}
                gc.collect()
                rows.append(row)
                plan.log(
                    f"  {size:>9} {algo_name:<22} {backend:<19} "
                    + (
                        f"{row['median_s'] * 1e3:9.3f} ms  ({row['reps']} reps, {time.perf_counter() - t0:.1f}s)"
                        if "median_s" in row
                        else f"ERROR {row['error']}"
                    )
                )
        del params
        gc.collect()


def _derive(rows: List[Row], plan: Plan) -> None:
    """GB/s, % of copy bandwidth, and speedups against reference and torch SGD, per row."""
    index = {(r["algorithm"], r["backend"], r["size"]): r for r in rows}
    for r in rows:
        if "median_s" not in r:
            continue
        r["gbps"] = r["bytes_per_step"] / r["median_s"] / 1e9
        r["pct_copy"] = 100.0 * r["gbps"] / r["copy_gbps"]
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
        # torch's fused SGD on the same list, whatever the algorithm: the step a user has today
        sgd = next(
            (o for (a, b, z), o in index.items() if b == TORCH_FUSED and z == r["size"] and "median_s" in o), None
        )
        r["vs_torch_sgd_step"] = r["median_s"] / sgd["median_s"] if sgd is not None else None
