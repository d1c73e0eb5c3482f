"""``python -m bench clients``: client-steps per second of one FL round, one client after another vs all at once.

The round: C clients, each from the same global model, K local steps of batch B on the simulator's
small CNN (8x8 single-channel inputs, 10 classes), FedNAR's update (lr 0.05, weight decay 5e-4,
max_norm 10). Throughput = C * K / (wall time of the round); each mode runs one untimed round, then
the best of ``--rounds`` timed rounds. Modes:

* ``sequential``: what FL libraries do: per client, load the global model, ``start_round``, K x
  (forward, backward, ``FedNAR.step``) with this package's per-client FedNAR (backend auto);
* ``batched-plain-torch``: one computation for all clients: ``vmap(grad)`` over stacked parameters
  (``fedopt_kernels.sim.parallel.loss``) and FedNAR written in plain torch on the stacked tensors;
* ``batched-fused``: the same gradients and ``BatchedFedNAR`` (backend auto): the simulator's
  ``--client-parallel`` step (``fedopt_kernels.sim.parallel.trainer``);
* ``batched-fused-graph`` (CUDA): that step captured once in a CUDA graph and replayed
  (``--cuda-graph``; ``fedopt_kernels.sim.parallel.step_graph``);
* ``batched-fused-chunked`` (C > ``--chunk``): the C clients in equal chunks of at most ``--chunk``,
  one chunk after another through one trainer (the simulator's ``--client-parallel N``; on CUDA
  with graph replay): what to do where one computation over all C clients gets slower per client.

Parts, per step at each C (median of repeated calls): the vmapped gradient alone, and the
optimizer update alone (plain torch vs BatchedFedNAR on fixed gradients): the "optimizer part".

Results: ``clients-<device>-<date>.{json,md,png}`` in ``--out-dir`` (default ``bench_runs/``,
git-ignored; ``--out-dir bench/results`` for the committed tables), listed in LATEST.md there.
"""

from __future__ import annotations

import argparse
import gc
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.nn import functional as F

from fedopt_kernels import FedNAR
from fedopt_kernels.batched import BatchedFedNAR
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.sim.models.small import SmallCNN
from fedopt_kernels.sim.parallel.loss import ClientLoss
from fedopt_kernels.sim.parallel.trainer import BatchedTrainer
from fedopt_kernels.sim.parallel_round import _pad_clients

from .contention import OtherLoad
from .machine import ROOT, loadavg, run_meta
from .timing import Budget, median, time_calls

HP: Dict[str, Any] = dict(lr=0.05, weight_decay=5e-4, max_norm=10.0)
SEQ, PLAIN, FUSED, GRAPH = "sequential", "batched-plain-torch", "batched-fused", "batched-fused-graph"
CHUNKED = "batched-fused-chunked"
MODES = (SEQ, PLAIN, FUSED, GRAPH, CHUNKED)
PART_BUDGET = Budget(warmup=2, min_reps=5, max_reps=200, min_time_s=0.5)

# the project's targets (benchmark goals, not tests)
GOALS = {
    "cpu": [
        ("batched-fused >= 8x sequential at C=50", lambda r: _ratio(r, 50, FUSED, SEQ), 8.0),
        ("optimizer part: batched-fused update >= 1.3x plain torch at C=50", lambda r: _part_ratio(r, 50), 1.3),
    ],
    "cuda": [
        (">= 250,000 client-steps/s at C=200 (graph)", lambda r: _rate(r, 200, GRAPH), 250_000.0),
        (
            "no collapse at C=1000: best batched rate >= rate at C=200 (graph)",
            lambda r: _div(_best(r, 1000), _rate(r, 200, GRAPH)),
            1.0,
        ),
    ],
}


# ------------------------------------------------------------------ the workload
class Workload:
    """A round's data and global model for C clients (random, seeded; the same for every mode)."""

    def __init__(self, clients: int, steps: int, batch: int, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.model = SmallCNN((1, 8, 8), 10).to(device)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.glob = [p.detach().clone() for p in self.model.parameters()]
        self.x = torch.randn(steps, clients, batch, 1, 8, 8, generator=g).to(device)
        self.y = torch.randint(0, 10, (steps, clients, batch), generator=g).to(device)
        self.w = torch.full((steps, clients, batch), 1.0 / batch, device=device)
        self.clients, self.steps, self.device = clients, steps, device


def plain_fednar_(
    params: List[torch.Tensor],
    grads: List[torch.Tensor],
    lr: float,
    weight_decay: float,
    max_norm: float,
    eps: float = 1e-6,
) -> None:
    """FedNAR on stacked [C, ...] tensors in plain torch, per client: d = g + wd x, x -= lr min(1, M/(|d|+eps)) d."""
    d = torch._foreach_add(grads, params, alpha=weight_decay)
    sq = torch.stack([t.reshape(t.shape[0], -1).square().sum(1) for t in d]).sum(0)
    coef = (max_norm / (sq.sqrt() + eps)).clamp(max=1.0) * lr
    for p, t in zip(params, d):
        p.sub_(t * coef.view(-1, *([1] * (t.dim() - 1))))


def sequential_round(wl: Workload, opt: FedNAR) -> None:
    model = wl.model
    params = list(model.parameters())
    for c in range(wl.clients):
        with torch.no_grad():
            for p, g in zip(params, wl.glob):
                p.copy_(g)
        opt.start_round()
        for k in range(wl.steps):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(wl.x[k, c]), wl.y[k, c]).backward()
            opt.step()


def plain_round(wl: Workload, loss: ClientLoss, stacked: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for s, g in zip(stacked, wl.glob):
            s.copy_(g.unsqueeze(0).expand_as(s))
    for k in range(wl.steps):
        grads, _ = loss.grads(stacked, wl.x[k], wl.y[k], wl.w[k])
        with torch.no_grad():
            plain_fednar_(stacked, list(grads), **HP)


def fused_trainer(wl: Workload, loss: ClientLoss, graph: Optional[str]) -> BatchedTrainer:
    return BatchedTrainer(loss, wl.glob, wl.clients, lambda ps: BatchedFedNAR(ps, **HP), steps=wl.steps, graph=graph)


def fused_round(wl: Workload, tr: BatchedTrainer) -> None:
    tr.load(wl.glob)
    tr.start_round(round_index=0)
    for k in range(wl.steps):
        tr.step(wl.x[k], wl.y[k], wl.w[k])


def chunked_round(wl: Workload, tr: BatchedTrainer) -> None:
    """The simulator's ``--client-parallel N`` with N < C: equal chunks of ``tr.clients``, one trainer."""
    n = tr.clients
    for i in range(0, wl.clients, n):
        m = min(n, wl.clients - i)
        active = torch.arange(n, device=wl.device) < m if m < n or tr.graph is not None else None
        tr.load(wl.glob)
        tr.start_round(round_index=0)
        for k in range(wl.steps):
            x, y, w = (_pad_clients(t[k : k + 1, i : i + m], n)[0] for t in (wl.x, wl.y, wl.w))
            tr.step(x, y, w, active=active)


# ------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_round(fn: Callable[[], None], device: torch.device, rounds: int) -> Dict[str, Any]:
    """One untimed round, then ``rounds`` timed ones: best and all wall times (seconds)."""
    fn()
    _sync(device)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"round_s": min(times), "round_times_s": times}


def _fused_backend(device: torch.device) -> str:
    return _registry.auto_backend(device, "fednar_batched")


def measure(C: int, args: argparse.Namespace, device: torch.device, log: Callable[[str], None]) -> List[Dict[str, Any]]:
    """Every mode and part at C clients."""
    rows: List[Dict[str, Any]] = []
    wl = Workload(C, args.steps, args.batch, device)
    loss = ClientLoss(wl.model)
    base = dict(clients=C, steps=args.steps, batch=args.batch)

    def add(mode: str, backend: str, fn: Callable[[], None]) -> None:
        row: Dict[str, Any] = dict(base, mode=mode, backend=backend)
        t0 = time.perf_counter()
        with OtherLoad() as others:
            try:
                row.update(best_round(fn, device, args.rounds))
                row["client_steps_per_s"] = C * args.steps / row["round_s"]
            except Exception as exc:  # a failing mode is a result, not a crash
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        row["other_load_cores"] = others.cores
        rows.append(row)
        gc.collect()
        log(
            f"  C={C:>5} {mode:<22} {backend:<10} "
            + (
                f"{row['client_steps_per_s']:>12,.0f} client-steps/s  ({time.perf_counter() - t0:.1f}s)"
                if "error" not in row
                else f"ERROR {row['error']}"
            )
        )

    modes = args.modes
    if SEQ in modes:
        if C <= args.seq_max_clients:
            opt = FedNAR(wl.model.parameters(), **HP)
            add(SEQ, opt.resolved_backend(), lambda: sequential_round(wl, opt))
        else:
            rows.append(
                dict(
                    base,
                    mode=SEQ,
                    skipped=f"C > --seq-max-clients {args.seq_max_clients} (client by client: "
                    f"its rate does not depend on C)",
                )
            )
    stacked = [g.unsqueeze(0).repeat(C, *([1] * g.dim())).contiguous() for g in wl.glob]
    if PLAIN in modes:
        add(PLAIN, "torch", lambda: plain_round(wl, loss, stacked))
    backend = _fused_backend(device)
    if FUSED in modes:
        tr = fused_trainer(wl, loss, None)
        add(FUSED, backend, lambda: fused_round(wl, tr))
        del tr
    # the reference batched ops read step counters on the host: not capturable (a failed capture
    # can leave the stream unusable for the cases after it)
    graph = "cuda" if device.type == "cuda" and backend != "reference" else None
    if GRAPH in modes and device.type == "cuda":
        if graph is None:
            rows.append(dict(base, mode=GRAPH, skipped="no fused client-batched backend to capture (reference)"))
        else:
            tr = fused_trainer(wl, loss, graph)
            add(GRAPH, backend, lambda: fused_round(wl, tr))
            del tr
    if CHUNKED in modes and C > args.chunk:
        chunks = math.ceil(C / args.chunk)
        size = math.ceil(C / chunks)
        tr = BatchedTrainer(loss, wl.glob, size, lambda ps: BatchedFedNAR(ps, **HP), steps=wl.steps, graph=graph)
        add(CHUNKED, backend, lambda: chunked_round(wl, tr))
        rows[-1]["chunk"] = size
        del tr

    # parts: the gradient alone, and the update alone on fixed gradients
    grads = [torch.randn_like(s) * 0.01 for s in stacked]
    parts = [
        ("vmap grad", "torch", lambda: loss.grads(stacked, wl.x[0], wl.y[0], wl.w[0])),
        ("update plain torch", "torch", lambda: plain_fednar_(stacked, grads, **HP)),
    ]
    params = [torch.nn.Parameter(s.clone()) for s in stacked]
    opt = BatchedFedNAR(params, **HP)
    for p, g in zip(params, grads):
        p.grad = g
    opt.start_round()
    parts.append(("update fused", backend, opt.step))
    for name, be, fn in parts:
        with OtherLoad() as others, torch.no_grad() if name.startswith("update") else torch.enable_grad():
            times = time_calls(fn, device, args.part_budget)
        rows.append(
            dict(base, part=name, backend=be, step_s=median(times), reps=len(times), other_load_cores=others.cores)
        )
        log(f"  C={C:>5} part {name:<18} {be:<10} {median(times) * 1e3:10.3f} ms/step")
    return rows


# ------------------------------------------------------------------ derived figures and goals
def _find(result: Dict[str, Any], C: int, mode: str) -> Optional[Dict[str, Any]]:
    for r in result["rows"]:
        if r.get("mode") == mode and r["clients"] == C and "client_steps_per_s" in r:
            return r
    return None


def _rate(result: Dict[str, Any], C: int, mode: str) -> Optional[float]:
    r = _find(result, C, mode)
    return None if r is None else r["client_steps_per_s"]


def _best(result: Dict[str, Any], C: int) -> Optional[float]:
    rates = [v for v in (_rate(result, C, m) for m in (FUSED, GRAPH, CHUNKED)) if v is not None]
    return max(rates) if rates else None


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def _ratio(result: Dict[str, Any], C: int, mode: str, other: str) -> Optional[float]:
    return _div(_rate(result, C, mode), _rate(result, C, other))


def _part(result: Dict[str, Any], C: int, name: str) -> Optional[float]:
    for r in result["rows"]:
        if r.get("part") == name and r["clients"] == C:
            return r["step_s"]
    return None


def _part_ratio(result: Dict[str, Any], C: int) -> Optional[float]:
    return _div(_part(result, C, "update plain torch"), _part(result, C, "update fused"))


def judge(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for text, value, threshold in GOALS.get(result["meta"]["device_type"], []):
        v = value(result)
        out.append(
            {
                "goal": text,
                "value": v,
                "threshold": threshold,
                "verdict": "n/a" if v is None else ("pass" if v >= threshold else "miss"),
            }
        )
    return out


# ------------------------------------------------------------------ report
def _fmt_rate(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _fmt_x(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2f}x"


def markdown(result: Dict[str, Any]) -> str:
    meta = result["meta"]
    sizes = meta["clients"]
    modes = [m for m in MODES if any(r.get("mode") == m for r in result["rows"])]
    lines = [
        f"# Client-batched training — {meta['device_name']} ({meta['date']})",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: `{meta['commit']}`{' (uncommitted changes)' if meta.get('dirty') else ''}; torch {meta['torch']}; "
        f"threads {meta['threads']}; wall time {meta['wall_s']:.0f} s; load average before/after "
        f"{meta.get('loadavg_before')} / {meta.get('loadavg_after')}",
        f"- round: C clients x K={meta['steps']} local steps of batch {meta['batch']}, simulator small CNN "
        f"(3,818 parameters), FedNAR update; best of {meta['rounds']} rounds after one untimed round",
        f"- batched optimizer backend (auto): {meta['fused_backend']}; sequential FedNAR backend (auto): "
        f"{meta['sequential_backend']}",
        "",
        "## Goals",
        "",
        "| goal | value | verdict |",
        "|---|---|---|",
    ]
    for g in result.get("goals", []):
        v = g["value"]
        shown = "—" if v is None else (f"{v:,.0f}" if g["threshold"] > 100 else f"{v:.3g}x")
        lines.append(f"| {g['goal']} | {shown} | **{g['verdict']}** |")
    lines += [
        "",
        "## Client-steps per second",
        "",
        "| clients | " + " | ".join(modes) + " | best fused / sequential | best fused / plain |",
        "|---|" + "---|" * (len(modes) + 2),
    ]
    for C in sizes:
        cells = []
        for m in modes:
            r = next((r for r in result["rows"] if r.get("mode") == m and r["clients"] == C), None)
            if r is None:
                cells.append("—")
            elif "error" in r:
                cells.append("error")
            elif "skipped" in r:
                cells.append("not run")
            else:
                cells.append(
                    _fmt_rate(r["client_steps_per_s"]) + (" ⚠" if (r.get("other_load_cores") or 0) > 0.25 else "")
                )
        best = _best(result, C)
        cells += [_fmt_x(_div(best, _rate(result, C, SEQ))), _fmt_x(_div(best, _rate(result, C, PLAIN)))]
        lines.append(f"| {C} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Parts, per step",
        "",
        "| clients | vmap grad | update plain torch | update fused | update: plain / fused |",
        "|---|---|---|---|---|",
    ]
    for C in sizes:
        g, p, f = (_part(result, C, n) for n in ("vmap grad", "update plain torch", "update fused"))
        fmt = lambda s: "—" if s is None else f"{s * 1e3:.3f} ms"  # noqa: E731
        lines.append(f"| {C} | {fmt(g)} | {fmt(p)} | {fmt(f)} | {_fmt_x(_div(p, f))} |")
    errors = [r for r in result["rows"] if "error" in r]
    skipped = [r for r in result["rows"] if "skipped" in r]
    if errors or skipped:
        lines += (
            [""]
            + [f"- C={r['clients']} {r['mode']}: error {r['error']}" for r in errors]
            + [f"- C={r['clients']} {r['mode']}: not run, {r['skipped']}" for r in skipped]
        )
    lines += ["", "⚠: other processes kept more than 0.25 cores busy during that case (CPU timings disturbed).", ""]
    return "\n".join(lines)


def _loglog(ax: Any, series: Dict[str, List[Any]], unit: float, ylabel: str, title: str) -> None:
    """One panel: a line per series of (C, value or None) points, values times ``unit``, log-log."""
    for label, pts in series.items():
        pts = [(C, v * unit) for C, v in pts if v is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients per round (C)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def chart(result: Dict[str, Any], path: Path) -> bool:
    """Client-steps/s and time per step against C; False, drawing nothing, without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["meta"]["clients"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rates = {m: [(C, _rate(result, C, m)) for C in sizes] for m in MODES}
    parts = {n: [(C, _part(result, C, n)) for C in sizes] for n in ("vmap grad", "update plain torch", "update fused")}
    _loglog(a, rates, 1.0, "client-steps / s", "round throughput")
    _loglog(b, parts, 1e3, "ms per step", "parts of one batched step")
    fig.suptitle(f"client-batched FedNAR — {result['meta']['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write(result: Dict[str, Any], out_dir: Path) -> Dict[str, Path]:
    """Write ``clients-<device>-<date>[-smoke].{json,md,png}`` into ``out_dir`` and refresh LATEST.md there."""
    from .report import save

    meta = result["meta"]
    stem = f"clients-{meta['device_slug']}-{meta['date']}" + ("-smoke" if meta.get("smoke") else "")
    return save(result, out_dir, stem, markdown, chart)


def render(json_path: Path) -> None:
    """Rewrite the markdown table and chart of a saved result (same numbers, current layout)."""
    from .report import rerender

    rerender(json_path, markdown, chart)


# ------------------------------------------------------------------ command line
def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench clients", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available)")
    ap.add_argument("--clients", type=int, nargs="+", default=[10, 50, 200, 1000], help="values of C")
    ap.add_argument("--steps", type=int, default=10, help="local steps K per client (default %(default)s)")
    ap.add_argument("--batch", type=int, default=10, help="batch size (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per mode, best taken (default %(default)s)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument(
        "--chunk",
        type=int,
        default=200,
        help=f"{CHUNKED}: for C above this, C clients in equal chunks of at most this many, one "
        f"after another (--client-parallel N; CUDA: graph replay) (default %(default)s)",
    )
    ap.add_argument(
        "--seq-max-clients",
        type=int,
        default=200,
        help="run the sequential mode only up to this C (default %(default)s: it is client by client, "
        "so its rate does not depend on C, and C=1000 takes minutes)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    ap.add_argument("--smoke", action="store_true", help="C in {2, 4}, K=2, one round: checks the machinery")
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=ROOT / "bench_runs",
        help="where the result files and LATEST.md go (default: bench_runs/, git-ignored)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--render", type=Path, metavar="RESULT.json", help="only redraw that result's .md and .png")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.chunk < 1:
        ap.error("--chunk must be >= 1")
    if any(c < 1 for c in args.clients):
        ap.error("--clients values must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    args.part_budget = PART_BUDGET
    if args.smoke:
        args.clients, args.steps, args.rounds = [2, 4], 2, 1
        args.part_budget = Budget(warmup=1, min_reps=2, max_reps=2, min_time_s=0.0)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    meta = run_meta(
        device,
        "python -m bench clients " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[2:])),
    )
    meta.update(
        mode="clients",
        dtype="float32",
        smoke=args.smoke,
        clients=args.clients,
        steps=args.steps,
        batch=args.batch,
        rounds=args.rounds,
        fused_backend=_fused_backend(device),
        sequential_backend=_registry.auto_backend(device, "fednar"),
        hp=HP,
    )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"bench clients: {meta['device_name']}, C in {args.clients}, K={args.steps}, batch {args.batch}")
    meta["loadavg_before"] = loadavg()
    t0 = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    for C in args.clients:
        rows += measure(C, args, device, log)
    meta["wall_s"] = time.perf_counter() - t0
    meta["loadavg_after"] = loadavg()
    result = {"meta": meta, "rows": rows}
    result["goals"] = judge(result)
    print(markdown(result))
    if not args.no_write:
        paths = write(result, args.out_dir)
        log("wrote " + ", ".join(str(p) for p in paths.values()))
        if "png" not in paths:
            log(
                "bench clients: no chart drawn: matplotlib is not installed (pip install 'fedopt_kernels[bench]' "
                "or pip install matplotlib)"
            )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
