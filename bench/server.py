"""``python -m bench server``: one server step of each server optimizer, beside what a user has instead.

Rows, per parameter list (float32, on ``--device``): the package's FedAvgM (momentum 0.9), FedAdam,
FedYogi, FedAdagrad and FedExP on ``--backend`` (default auto: the cpu backend on CPU tensors), then
``torch.optim.Adam(foreach=True)``, ``Adam(fused=True)`` and ``SGD(momentum=0.9, fused=True)`` on the
same tensors, and FedAdam as Flower's strategies compute it: a list of NumPy arrays (``m``, ``v`` and
the new weights built anew each round, as ``flwr.server.strategy.FedAdam.aggregate_fit`` does).

Lists: ``small_cnn`` (the simulator's CNN, 6 tensors), ``resnet18_gn`` (the simulator's ResNet-18
with GroupNorm: 62 tensors, 11.2M parameters) and ``resnet18`` (torchvision's ResNet-18 shapes: 62
tensors, 11.7M parameters). Each row's time is the median over ``--rounds`` rounds in which every
row of the list is timed in turn (interleaved, so all rows see the same machine load); ``copy`` is
``dst.copy_(src)`` over the bytes FedAdam's step moves (28 per float32 element), timed in the same
rounds, and ``% copy`` is a row's minimum bytes (docs/benchmarks.md: FedAvgM 20, FedAdam / FedYogi /
FedAdagrad / torch Adam / the NumPy step 28, FedExP 16, SGD with momentum 20) per second over the
copy's. ``vs Adam(foreach)``: the row's time over that row's. The machine is shared: medians, and
the load average at the start and the end is recorded. ``--threads 1`` times every row on
one thread: on a machine whose cores other processes hold, torch's multi-threaded ops (and the
copy) otherwise wait for their second thread.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

import fedopt_kernels as fk

from . import cli
from .machine import loadavg, run_meta
from .report import publish
from .shapes import resnet18_shapes, small_cnn_shapes
from .timing import median, sync

ADAM_FOREACH = "torch Adam(foreach)"
# minimum bytes per float32 element of each row's step
BYTES = {
    "FedAvgM": 20,
    "FedAdam": 28,
    "FedYogi": 28,
    "FedAdagrad": 28,
    "FedExP": 16,
    ADAM_FOREACH: 28,
    "torch Adam(fused)": 28,
    "torch SGD(momentum, fused)": 20,
    "NumPy FedAdam (Flower)": 28,
}
COPY = "copy (roofline)"


def resnet18_gn_shapes() -> List[tuple]:
    from fedopt_kernels.sim.models.resnet_gn import ResNet18GN

    return [tuple(p.shape) for p in ResNet18GN(3, 10).parameters()]


LISTS: Dict[str, Callable[[], List[tuple]]] = {
    "small_cnn": small_cnn_shapes,
    "resnet18_gn": resnet18_gn_shapes,
    "resnet18": resnet18_shapes,
}


def _tensors(shapes, device, seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def _torch_step(shapes, device, make: Callable[[List[torch.Tensor]], Any], **step_kw) -> Callable[[], None]:
    params = _tensors(shapes, device, 0)
    for p, g in zip(params, _tensors(shapes, device, 1), strict=True):
        p.grad = g * 1e-2
    opt = make(params)
    return lambda: opt.step(**step_kw)


def _numpy_fedadam(shapes, lr=1e-2, b1=0.9, b2=0.99, tau=1e-3) -> Callable[[], None]:
    """Flower's FedAdam on lists of arrays: delta = aggregate - weights, then m, v and the new weights
    as new arrays (the aggregate is given: the step alone is timed, as for the other rows)."""
    rng = np.random.default_rng(0)
    state: Dict[str, List[np.ndarray]] = {"x": [rng.standard_normal(s, dtype=np.float32) for s in shapes]}
    agg = [x + 1e-2 * rng.standard_normal(x.shape, dtype=np.float32) for x in state["x"]]
    state["m"] = [np.zeros_like(x) for x in state["x"]]
    state["v"] = [np.zeros_like(x) for x in state["x"]]

    def step() -> None:
        delta = [a - x for a, x in zip(agg, state["x"], strict=True)]
        state["m"] = [np.multiply(b1, m) + (1 - b1) * d for m, d in zip(state["m"], delta, strict=True)]
        state["v"] = [b2 * v + (1 - b2) * np.multiply(d, d) for v, d in zip(state["v"], delta, strict=True)]
        state["x"] = [
            x + lr * m / (np.sqrt(v) + tau) for x, m, v in zip(state["x"], state["m"], state["v"], strict=True)
        ]

    return step


def _copy(shapes, device) -> Callable[[], Any]:
    n = sum(int(np.prod(s)) for s in shapes) * BYTES["FedAdam"] // 8  # float32: read n*4, write n*4
    src = torch.randn(max(1, n), device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def cases(shapes, device, backend: str) -> Dict[str, Callable[[], Any]]:
    msn = torch.tensor(50.0, device=device)
    out: Dict[str, Callable[[], Any]] = {
        "FedAvgM": _torch_step(shapes, device, lambda p: fk.FedAvgM(p, lr=1.0, momentum=0.9, backend=backend)),
        "FedAdam": _torch_step(shapes, device, lambda p: fk.FedAdam(p, backend=backend)),
        "FedYogi": _torch_step(shapes, device, lambda p: fk.FedYogi(p, backend=backend)),
        "FedAdagrad": _torch_step(shapes, device, lambda p: fk.FedAdagrad(p, backend=backend)),
        "FedExP": _torch_step(shapes, device, lambda p: fk.FedExP(p, backend=backend), mean_sq_norm=msn),
        ADAM_FOREACH: _torch_step(
            shapes, device, lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.9, 0.99), eps=1e-3, foreach=True)
        ),
        "torch Adam(fused)": _torch_step(
            shapes, device, lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.9, 0.99), eps=1e-3, fused=True)
        ),
        "torch SGD(momentum, fused)": _torch_step(
            shapes, device, lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9, fused=True)
        ),
        COPY: _copy(shapes, device),
    }
    if device.type == "cpu":
        out["NumPy FedAdam (Flower)"] = _numpy_fedadam(shapes)
    return out


def _calls(numel: int) -> int:
    """Steps per timed block: about 20 ms of work on a laptop-class CPU, at least 1."""
    return max(1, min(200, int(2e6 // max(numel, 1))))


def time_list(name: str, device: torch.device, backend: str, rounds: int) -> Dict[str, Any]:
    shapes = LISTS[name]()
    numel = sum(int(np.prod(s)) for s in shapes)
    fns = cases(shapes, device, backend)
    calls = _calls(numel)
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: state made, plans built, kernels compiled
        for _ in range(3):
            fn()
    sync(device)
    for r in range(rounds):
        order = list(fns)
        order = order[r % len(order) :] + order[: r % len(order)]  # rotated: no row always follows another
        for k in order:
            fn = fns[k]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
            times[k].append((time.perf_counter() - t0) / calls)
    med = {k: median(v) for k, v in times.items()}
    copy_bw = numel * BYTES["FedAdam"] / med[COPY]
    rows = []
    for k, t in med.items():
        if k == COPY:
            continue
        rows.append(
            {
                "row": k,
                "seconds": t,
                "vs_adam_foreach": t / med[ADAM_FOREACH],
                "bytes_per_element": BYTES[k],
                "pct_copy": 100 * (numel * BYTES[k] / t) / copy_bw,
            }
        )
    return {
        "list": name,
        "tensors": len(shapes),
        "parameters": numel,
        "copy_seconds": med[COPY],
        "copy_gbs": copy_bw / 1e9,
        "rows": rows,
        "rounds": rounds,
        "calls_per_block": calls,
    }


def markdown(result: Dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"# Server step: {meta.get('device_name', meta.get('device'))}",
        "",
        f"`{meta['command']}` at commit {meta['commit']}{' (dirty)' if meta.get('dirty') else ''}, "
        f"{meta['date']}, torch {meta['torch']}, {meta['threads']} threads, backend `{result['backend']}`. "
        f"Load average {result['load_start']} at the start, {result['load_end']} at the end: a shared machine, "
        f"so each figure is a median over interleaved rounds and the spread between runs is large.",
        "",
    ]
    for lst in result["lists"]:
        lines += [
            f"## {lst['list']}: {lst['tensors']} tensors, {lst['parameters']:,} parameters",
            "",
            f"copy roofline (same rounds): {lst['copy_gbs']:.2f} GB/s",
            "",
            "| row | time / step | vs torch Adam(foreach) | bytes / element | % of copy |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in lst["rows"]:
            t = r["seconds"]
            shown = f"{t * 1e6:,.1f} µs" if t < 1e-3 else f"{t * 1e3:,.2f} ms"
            ratio, pct = f"{r['vs_adam_foreach']:.2f}x", f"{r['pct_copy']:.0f}%"
            lines.append(f"| {r['row']} | {shown} | {ratio} | {r['bytes_per_element']} | {pct} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = cli.parser("server", __doc__.split("\n\n")[0])
    cli.add_device(p)
    cli.add_output(p)
    p.add_argument("--backend", default="auto", help="the package's backend (default %(default)s)")
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds per list (default %(default)s)")
    p.add_argument("--lists", nargs="+", default=list(LISTS), choices=list(LISTS))
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for every row (default: torch's); 1 keeps a loaded machine's thread "
        "waits out of the comparison",
    )
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = cli.device_of(args.device)
    result: Dict[str, Any] = {
        "meta": run_meta(device, cli.command_line("server", argv if argv is not None else sys.argv[1:])),
        "backend": args.backend,
        "load_start": loadavg(),
        "lists": [],
    }
    for name in args.lists:
        result["lists"].append(time_list(name, device, args.backend, args.rounds))
        cli.log(f"server: {name} done")
    result["load_end"] = loadavg()
    threads = "" if args.threads is None else f"-threads{args.threads}"
    stem = f"server-{result['meta']['device_slug']}-{result['meta']['date']}{threads}"
    publish(result, cli.out_dir(args), stem, markdown, name="bench server")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
