"""``python -m fedopt_kernels.selfcheck``: every optimizer on every available backend against
``reference`` on random problems, printed as a table (the install's smoke test; the full matrix
is ``tests/test_equivalence.py``). Exits non-zero when a backend disagrees beyond tolerance."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Tuple

import torch

from . import FedDecaySGD, FedNAR, NeuronLRSGD, PAdaMFed, available_backends

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
SHAPES = [(64, 3, 3, 3), (64,), (128, 64), (1,), (0,), (1000,), (33, 17)]


def _problem(dtype: torch.dtype, device: str, seed: int) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in SHAPES]


def _controls(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [0.1 * torch.randn(p.shape, generator=g).to(p.device) for p in params]


BUILD: Dict[str, Callable] = {
    "FedDecaySGD": lambda ps, b: FedDecaySGD(ps, lr=0.05, beta=0.8, momentum=0.9, weight_decay=1e-3, backend=b),
    "NeuronLRSGD": lambda ps, b: NeuronLRSGD(ps, lr=0.05, momentum=0.9, backend=b,
                                            neuron_scales={p: torch.linspace(0.5, 2.0, p.shape[0], device=p.device)
                                                           for p in ps if p.dim() >= 1 and p.shape[0] > 0}),
    "FedNAR": lambda ps, b: FedNAR(ps, lr=0.1, weight_decay=0.1, max_norm=1.0, backend=b),
    "PAdaMFed": lambda ps, b: PAdaMFed(ps, lr=0.01, beta=0.5, backend=b),
}


def _run(name: str, backend: str, dtype: torch.dtype, device: str, rounds: int = 2, steps: int = 3):
    params = _problem(dtype, device, seed=1)
    opt = BUILD[name](params, backend)
    for rnd in range(rounds):
        if name == "PAdaMFed":
            opt.start_round(global_control=_controls(params, rnd), local_control=_controls(params, rnd + 9),
                            momentum=_controls(params, rnd + 99))
        else:
            opt.start_round()
        for k in range(steps):
            g = torch.Generator().manual_seed(100 * rnd + k)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(device=device, dtype=dtype)
            opt.step()
    return [p.detach().float().cpu() for p in params]


def _max_rel_err(ref: List[torch.Tensor], got: List[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(ref, got):
        if a.numel():
            worst = max(worst, float(((a - b).abs() / (1 + a.abs())).max()))
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    avail = available_backends(args.device)
    print(repr(avail))
    rows: List[Tuple[str, str, str, float, float, str]] = []
    for name in BUILD:
        for backend in [b for b in avail if b != "reference"]:
            for dtype in TOL:
                ref = _run(name, "reference", dtype, args.device)
                got = _run(name, backend, dtype, args.device)
                err = _max_rel_err(ref, got)
                rows.append((name, backend, str(dtype).replace("torch.", ""), err, TOL[dtype],
                             "ok" if err <= TOL[dtype] else "FAIL"))
    if not rows:
        print("only the reference backend is available: nothing to compare")
        return 0
    print(f"\n{'optimizer':<12} {'backend':<8} {'dtype':<9} {'max rel err':>12} {'tolerance':>10}  result")
    for r in rows:
        print(f"{r[0]:<12} {r[1]:<8} {r[2]:<9} {r[3]:>12.3e} {r[4]:>10.1e}  {r[5]}")
    failed = [r for r in rows if r[5] != "ok"]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
