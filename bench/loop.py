"""``python -m bench loop``: a user's training loop, wall time per iteration.

Each iteration is what a client's local training does: ``zero_grad(set_to_none=True)`` (torch's
default), forward, cross-entropy, backward, ``step()``. Models: the simulator's ``SmallCNN`` on
8x8 single-channel images and ``ResNet18GN`` on 32x32 RGB (CIFAR), batch 32, random data already
on the device. Optimizers doing the same work (momentum 0.9, weight decay 5e-4, lr 0.05):
``FedDecaySGD`` (beta 1, i.e. plain SGD) on each fused backend - replaying steps as it does by
default, and with ``replay=False`` - and ``torch.optim.SGD(fused=True)``; ``FedNAR`` beside it, the
algorithm whose hand-written alternative costs most. A row gives the median over timed blocks of
the wall time per iteration (the device is waited for at each block's end), and for the package's
optimizers how their steps ran (``replay_stats``: replayed out of all steps); then, untimed, how
many different gradient address sets 20 more iterations gave (what decides whether steps can replay).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

import fedopt_kernels as fk
from fedopt_kernels.sim.models.resnet_gn import ResNet18GN
from fedopt_kernels.sim.models.small import SmallCNN

from .machine import ROOT, run_meta

MODELS: Dict[str, Callable[[], tuple]] = {
    # name -> (model, input shape per sample, classes)
    "small_cnn": lambda: (SmallCNN((1, 8, 8), 10), (1, 8, 8), 10),
    "resnet18": lambda: (ResNet18GN(3, 10), (3, 32, 32), 10),
}
BATCH = 32
PROBE = 20  # iterations after the timed ones whose gradient addresses are counted
SGD = dict(lr=0.05, momentum=0.9, weight_decay=5e-4)


def _optimizers(backends: List[str]) -> Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]]:
    out: Dict[str, Callable[[List[torch.Tensor]], torch.optim.Optimizer]] = {
        "torch.SGD(fused)": lambda ps: torch.optim.SGD(ps, fused=True, **SGD)}
    for b in backends:
        out[f"FedDecaySGD {b}"] = lambda ps, b=b: fk.FedDecaySGD(ps, beta=1.0, backend=b, **SGD)
        out[f"FedDecaySGD {b} eager"] = lambda ps, b=b: fk.FedDecaySGD(ps, beta=1.0, backend=b, replay=False, **SGD)
        out[f"FedNAR {b}"] = lambda ps, b=b: fk.FedNAR(ps, lr=SGD["lr"], weight_decay=SGD["weight_decay"],
                                                       max_norm=1.0, backend=b)
    return out


def time_loop(model_name: str, make_opt: Callable, device: torch.device, warmup: int, blocks: int,
              per_block: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model, shape, classes = MODELS[model_name]()
    model = model.to(device)
    opt = make_opt(list(model.parameters()))
    x = torch.randn((BATCH,) + shape, device=device)
    y = torch.randint(0, classes, (BATCH,), device=device)
    loss_fn = nn.CrossEntropyLoss()

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        iteration()
    torch.cuda.synchronize(device)
    per_iter = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(per_block):
            iteration()
        torch.cuda.synchronize(device)
        per_iter.append((time.perf_counter() - t0) / per_block)
    row: Dict[str, Any] = {"model": model_name, "median_s": statistics.median(per_iter), "min_s": min(per_iter)}
    if hasattr(opt, "replay_stats"):
        row["replay"] = opt.replay_stats()
    row["address_sets"] = address_sets(iteration, list(model.parameters()))
    return row


def address_sets(iteration: Callable[[], None], params: List[torch.Tensor], iterations: int = PROBE) -> int:
    """How many different gradient address sets ``iterations`` more iterations see (untimed): 1 or 2
    when the caching allocator hands the gradients the same blocks back, so steps can replay."""
    seen = set()
    for _ in range(iterations):
        iteration()
        seen.add(tuple(p.grad.data_ptr() if p.grad is not None else 0 for p in params))
    return len(seen)


def markdown(result: Dict[str, Any]) -> str:
    m = result["meta"]
    lines = [f"# A user's training loop: {m['device_name']}", "",
             f"- {m['date']}, commit `{m['commit']}`, torch {m['torch']}; `{m['command']}`",
             f"- iteration: zero_grad(set_to_none=True), forward, loss, backward, step; batch {BATCH}; "
             f"median over {m['blocks']} blocks of {m['per_block']} iterations after {m['warmup']} warm-up",
             "", "| model | optimizer | ms / iteration | x torch.SGD(fused) | steps replayed | "
             f"gradient address sets in {PROBE} iterations |", "|---|---|---|---|---|---|"]
    base = {r["model"]: r["median_s"] for r in result["rows"] if r["optimizer"] == "torch.SGD(fused)"}
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['optimizer']} | error: {r['error']} | | | |")
            continue
        rep = r.get("replay")
        replayed = "—" if rep is None else f"{rep['replayed']}/{rep['eager'] + rep['recorded'] + rep['replayed']}"
        ratio = base.get(r["model"], 0) / r["median_s"] if r["model"] in base else None
        lines.append(f"| {r['model']} | {r['optimizer']} | {1e3 * r['median_s']:.3f} | "
                     f"{'—' if ratio is None else f'{ratio:.2f}x'} | {replayed} | {r.get('address_sets', '—')} |")
    lines.append("")
    lines.append("x torch.SGD(fused) > 1: the iteration is faster than with torch's fused SGD.")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--per-block", type=int, default=20)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench_runs")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("bench loop: needs a CUDA device (replayed steps are a GPU feature)", file=sys.stderr)
        return 2
    backends = [b for b in ("cuda", "triton") if b in fk.available_backends(device)]
    meta = run_meta(device, "python -m bench loop " + " ".join(argv if argv is not None else sys.argv[1:]))
    meta.update(warmup=args.warmup, blocks=args.blocks, per_block=args.per_block)
    rows = []
    for model_name in args.models:
        for name, make in _optimizers(backends).items():
            try:
                row = time_loop(model_name, make, device, args.warmup, args.blocks, args.per_block)
            except Exception as exc:  # a failing optimizer is a result, not a crash
                row = {"model": model_name, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
            row["optimizer"] = name
            rows.append(row)
            print(f"  {model_name:<10} {name:<26} "
                  + (f"{1e3 * row['median_s']:.3f} ms" if "median_s" in row else row["error"]), file=sys.stderr)
    result = {"meta": meta, "rows": rows}
    text = markdown(result)
    print(text)
    if not args.no_write:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem = f"loop-{meta['device_slug']}-{meta['date']}"
        (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
        (args.out_dir / f"{stem}.md").write_text(text + "\n")
        print(f"wrote {args.out_dir / stem}.json/.md", file=sys.stderr)
    return 0
