"""The papers' own settings (CIFAR-10, ResNet-18 / CNN) as ``fedopt-sim`` commands for one GPU,
and their wall time estimated from a short slice.

    python experiments/paper_commands.py --print                   # the commands (results_real.md)
    python experiments/paper_commands.py --time --device cuda      # time a slice of each, on a GPU

``--time`` needs no CIFAR-10: it writes a stand-in folder of random images in CIFAR-10's exact
layout and size (50,000 + 10,000 images), since a round costs the same whatever the pixels. For
each paper it builds the first configuration of the method's grid and of the baseline's exactly
as ``fedopt-sim`` would from the command (its own parser and ``config_from_args``), then times the
set-up, ``--slice-rounds`` rounds (the first is a warm-up and is left out: kernels compile,
graphs are captured), one validation pass and the final evaluation. A run's estimate is set-up +
rounds x round + (rounds / eval-every) x validation + final evaluation (the set-up includes the
client-batched engine's formulation search, once per run); a grid's, that times its configurations
and seeds. Each paper's method command is also timed with its clients one after another
(``--client-batched 1``, what FL libraries do), beside the client-batched estimate. Results go to
``--out-dir`` as paper-commands-<device>.json/.md.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SEEDS = "0 1 2 3 4"
# (name, paper and its number, shared arguments, [(label, its own arguments)] for the method, the same
# for the baseline); every grid lists the method first. lr grids are equal in size for method and
# baseline (protocol.md's rule: a method's own knob buys the baseline as many lr points).
FEDNLR_LRS = ("0.01", "0.0316", "0.1")
FEDAVG_LRS = tuple(f"{0.01 * 10 ** (k / 8):.3g}" for k in range(9))  # 0.01 ... 0.1, eighth decades
PAPERS: List[Tuple[str, str, str, List[Tuple[str, str]], List[Tuple[str, str]]]] = [
    (
        "fednar",
        "FedNAR, CIFAR-10 Dir(0.3), ResNet-18 (Table 1: FedAvg 85.19 -> 87.64, FedProx 85.02 -> 87.45, "
        "SCAFFOLD 86.89 -> 89.17)",
        "--dataset cifar10 --data-dir DATA --clients 100 --alpha 0.3 --holdout-fraction 0 --split 0.8 0.1 0.1 "
        "--model resnet18-gn --augment --round-decay 0.998 --clip-norm 10 --clients-per-round 20 --local-steps 20 "
        "--batch-size 50 --rounds 1000 --finetune-steps 0 --eval-every 20 --device cuda --client-batched 20",
        [
            (f"{algo}-wd{wd}-lr{lr}", f"--algorithm {algo} --weight-decay {wd} --lr {lr}")
            for algo in ("fednar", "fednar-fedprox", "fednar-scaffold")
            for wd in ("0.01", "0.1")
            for lr in ("0.01", "0.03")
        ],
        [
            (f"{algo}-wd{wd}-lr{lr}", f"--algorithm {algo} --weight-decay {wd} --lr {lr}")
            for algo in ("fedavg", "fedprox", "scaffold")
            for wd in ("0.01", "0.1")
            for lr in ("0.01", "0.03")
        ],
    ),
    (
        "fednlr",
        "FedNLR, CIFAR-10 Shards(100, 4), 10% of clients per round (Table 3: FedAvg 72.94 -> 73.38)",
        "--dataset cifar10 --data-dir DATA --clients 100 --partition shards --shards-per-client 4 "
        "--holdout-fraction 0 --split 0.8 0.1 0.1 --model cnn --clients-per-round 10 --local-steps 50 "
        "--batch-size 50 --rounds 500 --finetune-steps 0 --eval-every 20 --device cuda --client-batched 10",
        [
            (f"fednlr-mu{mu}-lr{lr}", f"--algorithm fednlr --nlr-mu0 {mu} --lr {lr}")
            for mu in ("0.5", "1", "2")
            for lr in FEDNLR_LRS
        ],
        [(f"fedavg-lr{lr}", f"--algorithm fedavg --lr {lr}") for lr in FEDAVG_LRS],
    ),
]


def command(shared: str, own: str, label: str, name: str) -> List[str]:
    return [
        "fedopt-sim",
        *shlex.split(shared),
        *shlex.split(own),
        "--seeds",
        *SEEDS.split(),
        "--out",
        f"runs/{name}/{label}",
    ]


def print_commands() -> str:
    """One command per line, every configuration of every grid (the block results_real.md shows)."""
    lines = []
    for name, paper, shared, method, baseline in PAPERS:
        lines.append(f"# {paper}: {len(method)} + {len(baseline)} configurations x 5 seeds")
        for label, own in method + baseline:
            lines.append(shlex.join(command(shared, own, label, name)))
    lines.append("# FedDecay, FEMNIST (LEAF), 20% new users (Table 3: 91.52 vs 90.55): experiments/real_data.md 1a")
    return "\n".join(lines)


# ------------------------------------------------------------------ a stand-in CIFAR-10
def write_standin_cifar10(root: Path, train: int = 50000, test: int = 10000, seed: int = 0) -> Path:
    """Random images in the layout of the official python archive (5 train batches, a test batch,
    batches.meta), so the simulator reads it as CIFAR-10."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    per = train // 5
    for name, n in [(f"data_batch_{i}", per) for i in range(1, 6)] + [("test_batch", test)]:
        labels = rng.integers(0, 10, size=n)
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump(
                {
                    "batch_label": name,
                    "labels": [int(v) for v in labels],
                    "data": data,
                    "filenames": [f"{i}.png" for i in range(n)],
                },
                f,
                protocol=2,
            )
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": per, "num_vis": 3072}, f, protocol=2)
    return root


# ------------------------------------------------------------------ timing a slice
def time_slice(
    argv: Sequence[str], data_dir: str, device: str, rounds: int, shrink: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """Set-up, per-round, validation and final-evaluation seconds of one configuration (seed 0)."""
    import torch

    from fedopt_kernels.sim.cli.fedopt_sim import build_parser, config_from_args
    from fedopt_kernels.sim.evaluate import pooled_metrics
    from fedopt_kernels.sim.simulation import Simulation

    args = build_parser().parse_args(list(argv[1:]))  # argv[0] is "fedopt-sim"
    cfg = config_from_args(args, 0).replace(data_dir=data_dir, device=device, **(shrink or {}))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    sim = Simulation(cfg)
    if sim.batched is not None:
        sim.batched.size  # noqa: B018 - the formulation search happens here, once per run: part of the set-up
    sync()
    setup = time.perf_counter() - t0
    per_round = []
    for t in range(rounds):  # rounds 1..rounds of a long run: no validation among them (eval_every > rounds)
        t0 = time.perf_counter()
        sim.run_round(t)
        sync()
        per_round.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    pooled_metrics(sim.model, sim.train_clients, "val")
    sync()
    val = time.perf_counter() - t0
    t0 = time.perf_counter()
    sim.final_evaluation()
    sync()
    final = time.perf_counter() - t0
    steady = per_round[1:] or per_round
    rnd = statistics.median(steady)
    full_rounds, every = args.rounds, args.eval_every
    estimate = setup + full_rounds * rnd + (full_rounds // every) * val + final
    return {
        "setup_s": setup,
        "round_s": rnd,
        "first_round_s": per_round[0],
        "rounds_timed": rounds,
        "validation_s": val,
        "final_evaluation_s": final,
        "rounds": full_rounds,
        "eval_every": every,
        "estimate_s": estimate,
        "engine": "sequential" if sim.batched is None else f"client-batched, {sim.batched.size} at once",
        "search_s": 0.0 if sim.batched is None or sim.batched.chooser is None else sim.batched.chooser.spent_s,
        "formulations": None if sim.batched is None else sim.batched.choice_state().get("formulations"),
        "config": {k: v for k, v in vars(cfg).items() if not k.startswith("_")},
    }


def time_all(
    device: str,
    rounds: int,
    out_dir: Path,
    shrink: Optional[Dict[str, Any]] = None,
    images: Tuple[int, int] = (50000, 10000),
    papers: Optional[Sequence[str]] = None,
    sequential: bool = True,
) -> Dict[str, Any]:
    import platform

    import torch

    results: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(0)
        if device.startswith("cuda")
        else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "images": list(images),
        "shrink": shrink or {},
        "papers": {},
    }
    from bench.stopping import sigterm_interrupts

    try:
        with sigterm_interrupts(), tempfile.TemporaryDirectory() as tmp:
            write_standin_cifar10(Path(tmp), *images)
            for name, paper, shared, method, baseline in PAPERS:
                if papers and name not in papers:
                    continue
                rows: Dict[str, Any] = {}
                results["papers"][name] = {"paper": paper, "rows": rows}
                slices: List[Tuple[str, List[Tuple[str, str]], Dict[str, Any]]] = [
                    ("method", method, {}),
                    ("baseline", baseline, {}),
                ]
                if sequential:  # the method's command with its clients one after another, as FL libraries train
                    slices.append(("method, sequential", method, {"client_batched": 1, "replay": False}))
                for role, grid, change in slices:
                    label, own = grid[0]
                    argv = command(shared, own, label, name)
                    row = time_slice(argv, tmp, device, rounds, {**(shrink or {}), **change})
                    row.update(label=label, command=shlex.join(argv), configurations=len(grid))
                    if change:
                        row["command"] += " # with --client-batched 1"
                    rows[role] = row
                results["papers"][name]["grid_estimate_s"] = sum(
                    r["estimate_s"] * r["configurations"] * 5 for role, r in rows.items() if "sequential" not in role
                )
    except KeyboardInterrupt:  # a deadline (gpu_check sends SIGINT) or kill (SIGTERM): keep the slices timed so far
        results["interrupted"] = True
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"paper-commands-{'cuda' if device.startswith('cuda') else 'cpu'}"
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(results))
    return results


def markdown(res: Dict[str, Any]) -> str:
    shrunk = f" (shrunk for a smoke run: {res['shrink']})" if res["shrink"] else ""
    cut = " **Interrupted**: only the slices timed before the stop." if res.get("interrupted") else ""
    lines = [
        f"## The papers' commands on {res['device']}{shrunk}",
        "",
        f"{res['date']}, torch {res['torch']}; a stand-in CIFAR-10 of {res['images'][0]:,} + "
        f"{res['images'][1]:,} random images; seed 0; `python experiments/paper_commands.py --time`{cut}",
        "",
        "| paper | run | engine | set-up (formulation search) | round (median after the first) | validation | "
        "final evaluation | one run (estimate) | vs sequential | the grid x 5 seeds (estimate) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in res["papers"].values():
        seq = p["rows"].get("method, sequential")
        for role, r in p["rows"].items():
            grid = r["estimate_s"] * r["configurations"] * 5
            faster = f"{seq['estimate_s'] / r['estimate_s']:.1f}x" if seq is not None and role == "method" else ""
            lines.append(
                f"| {p['paper'].split(',')[0]} | {role}: {r['label']} ({r['rounds']} rounds) | "
                f"{r.get('engine', '')} | {r['setup_s']:.1f} s ({r.get('search_s', 0.0):.1f} s) | "
                f"{1000 * r['round_s']:.0f} ms | {r['validation_s']:.2f} s | "
                f"{r['final_evaluation_s']:.2f} s | {_duration(r['estimate_s'])} | {faster} | "
                + ("" if "sequential" in role else f"{grid / 3600:.1f} h ({r['configurations']} configurations)")
                + " |"
            )
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.2f} h"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--print", action="store_true", help="print the commands")
    what.add_argument("--time", action="store_true", help="time a slice of each paper's first configurations")
    ap.add_argument("--device", default="cuda", help="where the slice runs (default cuda)")
    ap.add_argument("--slice-rounds", type=int, default=4, help="rounds timed per configuration (default 4)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench_runs"), help="where the table goes")
    ap.add_argument(
        "--paper",
        action="append",
        choices=[name for name, *_ in PAPERS],
        help="time only this paper's slices (repeatable; default every paper)",
    )
    ap.add_argument(
        "--no-sequential",
        dest="sequential",
        action="store_false",
        help="do not time each paper's method command with its clients one after another (--client-batched 1)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny slice (2 clients per round, 1 local step, 600 images): checks the code on a CPU",
    )
    args = ap.parse_args(argv)
    if args.slice_rounds < 1:
        ap.error("--slice-rounds must be >= 1")
    if args.print:
        print(print_commands())
        return 0
    # a smoke slice keeps the defaults: a search's budget is a share of the whole (unshrunk) run's time
    shrink = (
        dict(clients_per_round=2, local_steps=1, batch_size=4, client_batched=2, formulations="default")
        if args.smoke
        else None
    )
    res = time_all(
        args.device,
        args.slice_rounds,
        args.out_dir,
        shrink,
        (500, 100) if args.smoke else (50000, 10000),
        args.paper,
        args.sequential,
    )
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
