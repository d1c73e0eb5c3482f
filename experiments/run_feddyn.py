"""FedDyn vs FedAvg vs SCAFFOLD on the built-in data (no download): scikit-learn digits with a
Dirichlet(0.1) label skew, and FedProx's Synthetic(1, 1).

    python experiments/run_feddyn.py            # 3 seeds x 2 data sets x 3 algorithms
    python experiments/run_feddyn.py --quick    # 1 seed, 3 rounds: checks the script runs (JSON to the temp folder)

The settings below were fixed before any result was seen: 50 clients (10 held out as new users),
10 sampled per round, 10 local steps of batch 10, client lr 0.05, 60 rounds, FedDyn's alpha 0.01
(the middle of the paper's grid {0.1, 0.01, 0.001}); every algorithm with the same seeds sees the
same clients and batches. Writes ``experiments/real/feddyn.json`` and prints a markdown table of the
global model's pooled test accuracy and final training loss (mean ± std over seeds);
``experiments/results_feddyn.md`` holds the table with its reading.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

ALGORITHMS = ("fedavg", "scaffold", "feddyn")
DATA = {
    "digits (Dirichlet 0.1)": dict(dataset="digits", partition="dirichlet", dirichlet_alpha=0.1, model="mlp"),
    "Synthetic(1, 1)": dict(dataset="synthetic", synthetic_alpha=1.0, synthetic_beta=1.0, model="mlp"),
}
COMMON = dict(
    clients=50,
    holdout_fraction=0.2,
    clients_per_round=10,
    local_steps=10,
    batch_size=10,
    lr=0.05,
    rounds=60,
    eval_every=10,
)
EXTRA = {"feddyn": dict(dyn_alpha=0.01)}


def run(cfg: Dict[str, Any]) -> Dict[str, Any]:
    from fedopt_kernels.sim import SimConfig, Simulation

    start = time.perf_counter()
    result = Simulation(SimConfig(**cfg)).run()
    hist = result["history"]
    return {
        "config": cfg,
        "pooled_test_acc": result["final"]["pooled_test_acc"],
        "train_loss": hist[-1]["train_loss"],
        "curve": [(h["round"], h["val_acc"]) for h in hist if "val_acc" in h],
        "seconds": time.perf_counter() - start,
    }


def table(runs: List[Dict[str, Any]]) -> str:
    lines = ["| data | algorithm | pooled test acc (%) | final train loss | seconds / run |", "|---|---|---|---|---|"]
    for data in DATA:
        for algo in ALGORITHMS:
            rs = [r for r in runs if r["data"] == data and r["config"]["algorithm"] == algo]
            if not rs:
                continue
            acc = 100 * np.array([r["pooled_test_acc"] for r in rs])
            loss = np.array([r["train_loss"] for r in rs])

            def sd(a):
                return f" ± {a.std(ddof=1):.2f}" if len(a) > 1 else ""

            lines.append(
                f"| {data} | {algo} | {acc.mean():.2f}{sd(acc)} | {loss.mean():.3f}{sd(loss)} | "
                f"{np.mean([r['seconds'] for r in rs]):.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="1 seed, 3 rounds (checks the script; JSON to the temp folder)"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("FEDOPT_THREADS", "1")))
    seeds = args.seeds[:1] if args.quick else args.seeds
    runs = []
    for data, dcfg in DATA.items():
        for algo in ALGORITHMS:
            for seed in seeds:
                cfg = {**COMMON, **dcfg, "algorithm": algo, "seed": seed, **EXTRA.get(algo, {})}
                if args.quick:
                    cfg.update(rounds=3, eval_every=1)
                r = run(cfg)
                r["data"] = data
                runs.append(r)
                print(
                    f"{data:24s} {algo:9s} seed {seed}: acc {100 * r['pooled_test_acc']:.2f} "
                    f"loss {r['train_loss']:.3f} ({r['seconds']:.1f} s)",
                    flush=True,
                )
    out = Path(tempfile.gettempdir()) / "feddyn.json" if args.quick else HERE / "real" / "feddyn.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "torch_threads": torch.get_num_threads(),
                "runs": runs,
            },
            indent=1,
        )
    )
    print(table(runs))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
