"""``python -m fedopt_kernels.selfcheck``: every optimizer on every available backend against
``reference`` on random problems, printed as a table (the install's smoke test; the full matrix
is ``tests/test_equivalence.py``). Configurations come from ``fedopt_kernels.fl.catalogue`` (each
algorithm's option set that exercises every role of its op). Exits non-zero when a backend
disagrees beyond tolerance."""

from __future__ import annotations

import argparse
import sys
from typing import List, Tuple

import torch

from . import available_backends
from .fl import catalogue

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
SHAPES = [(64, 3, 3, 3), (64,), (128, 64), (1,), (0,), (1000,), (33, 17)]


def _problem(dtype: torch.dtype, device: str, seed: int) -> List[torch.Tensor]:  # Parameters
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in SHAPES]


def _run(cfg: catalogue.Config, backend: str, dtype: torch.dtype, device: str) -> List[torch.Tensor]:
    params = _problem(dtype, device, seed=1)
    catalogue.run(cfg, params, backend, rounds=2, steps=3, seed=1)
    return [p.detach().float().cpu() for p in params]


def _max_rel_err(ref: List[torch.Tensor], got: List[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(ref, got, strict=True):
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
    for algo in catalogue.ALGOS.values():
        cfg = algo.options[algo.full]
        name = f"{algo.cls.__name__} ({cfg.option})"
        for backend in [b for b in avail if b != "reference"]:
            for dtype in TOL:
                ref = _run(cfg, "reference", dtype, args.device)
                got = _run(cfg, backend, dtype, args.device)
                err = _max_rel_err(ref, got)
                rows.append(
                    (
                        name,
                        backend,
                        str(dtype).replace("torch.", ""),
                        err,
                        TOL[dtype],
                        "ok" if err <= TOL[dtype] else "FAIL",
                    )
                )
    if not rows:
        print("only the reference backend is available: nothing to compare")
        return 0
    width = max(len(r[0]) for r in rows)
    print(f"\n{'optimizer':<{width}} {'backend':<8} {'dtype':<9} {'max rel err':>12} {'tolerance':>10}  result")
    for r in rows:
        print(f"{r[0]:<{width}} {r[1]:<8} {r[2]:<9} {r[3]:>12.3e} {r[4]:>10.1e}  {r[5]}")
    failed = [r for r in rows if r[5] != "ok"]
    print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
