"""The four papers' experiments on real data this machine can install: MNIST, Fashion-MNIST, Shakespeare.

    bash experiments/get_data.sh                      # installs the three packages, prints the folders
    python experiments/run_real_data.py fednlr   --mnist DIR
    python experiments/run_real_data.py padamfed --fmnist DIR
    python experiments/run_real_data.py fednar   --shakespeare DIR
    python experiments/run_real_data.py feddecay --shakespeare DIR
    python experiments/run_real_data.py ... --quick   # 1 seed, a few rounds: checks the script runs
                                                      # (its JSON goes to the temp folder)

Each writes ``experiments/real/<name>.json`` (every run's final metrics, its wall time, the machine's
load average before and after) and prints a markdown table; ``experiments/results_real_superseded.md``
holds the tables (superseded by ``run_protocol.py`` and ``experiments/protocol.md``). Settings
are fixed below before any result was seen; every scale-down against the paper is listed in
``SCALE_DOWN``. Runs are in-process, one after another, on one torch thread (``FEDOPT_THREADS=N``
for more: on a quiet machine 2 threads help the client-batched runs; on a loaded one they spin
against each other).
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("FEDOPT_REAL_OUT", HERE / "real"))  # where the JSON goes
sys.path.insert(0, str(HERE.parent))


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def run(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One simulation; its final metrics, last validation accuracy and wall time."""
    from fedopt_kernels.sim import SimConfig, Simulation
    from fedopt_kernels.sim.report import final_rows

    start = time.perf_counter()
    result = Simulation(SimConfig(**cfg)).run()
    hist = result["history"]
    return {
        "config": cfg,
        "final": final_rows(result["final"]),
        "val_acc": hist[-1].get("val_acc"),
        "train_loss": hist[-1]["train_loss"],
        "curve": [(h["round"], h["val_acc"]) for h in hist if "val_acc" in h],
        "hparams": result["hparams"],
        "seconds": time.perf_counter() - start,
    }


def mean_std(values: Sequence[float]) -> str:
    a = 100 * np.asarray(values, dtype=np.float64)
    if len(a) == 1:
        return f"{a[0]:.2f}"
    return f"{a.mean():.2f} ± {a.std(ddof=1):.2f}"


def save(name: str, payload: Dict[str, Any]) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(payload, indent=1, default=float) + "\n")


def sweep(name: str, settings: Dict[str, Dict[str, Any]], seeds: Sequence[int]) -> Tuple[Dict[str, List], Dict]:
    """label -> config; every label over every seed. Returns (label -> runs, timing)."""
    import torch

    torch.set_num_threads(int(os.environ.get("FEDOPT_THREADS", "1")))  # 1: the fastest on a shared, busy machine
    info: Dict[str, Any] = {
        "load_before": load(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    start = time.perf_counter()
    out: Dict[str, List] = {}
    for label, cfg in settings.items():
        for s in seeds:
            r = run({**cfg, "seed": s})
            out.setdefault(label, []).append(r)
            print(
                f"[{name}] {label} seed {s}: pooled test {100 * r['final']['pooled test acc']:.2f}% "
                f"({r['seconds']:.0f} s, load {load()})",
                flush=True,
            )
    info.update(wall_seconds=time.perf_counter() - start, load_after=load())
    return out, info


# ------------------------------------------------------------------ FedNLR: MNIST, one class per client
def fednlr(args: argparse.Namespace) -> None:
    import torch

    base = dict(
        dataset="mnist",
        data_dir=args.mnist,
        model="mlp1",
        hidden=25,
        partition="classes",
        clients=10,
        holdout_fraction=0.0,
        clients_per_round=10,
        local_steps=10,
        batch_size=32,
        lr=0.05,
        rounds=3 if args.quick else 60,
        eval_every=5,
        finetune_steps=0,
        split=(0.8, 0.1, 0.1),
        backend="reference",
        device="cpu",
        client_batched=10,
    )
    seeds = [0] if args.quick else [0, 1, 2]
    runs, info = sweep(
        "fednlr", {"FedAvg": dict(base, algorithm="fedavg"), "FedNLR": dict(base, algorithm="fednlr")}, seeds
    )
    drift = [neuron_drift(base, s, args.quick) for s in seeds]
    info["drift_seconds"] = sum(d["seconds"] for d in drift)
    save("fednlr", {"runs": runs, "drift": drift, "timing": info})
    print("| method | pooled test acc (%) | val acc (%) |\n|---|---|---|")
    for label, rs in runs.items():
        print(
            f"| {label} | {mean_std([r['final']['pooled test acc'] for r in rs])} | "
            f"{mean_std([r['val_acc'] for r in rs])} |"
        )
    print("\n| seed | model acc (%) | bounded neurons (pairs) | change on C-2, FedAvg | change on C-2, FedNLR |")
    print("|---|---|---|---|---|")
    for s, d in zip(seeds, drift):
        print(
            f"| {s} | {100 * d['model_acc']:.1f} | {d['bounded']} ({d['pairs']}) | {d['fedavg']:+.4f} | "
            f"{d['fednlr']:+.4f} |"
        )
    print(
        f"wall {info['wall_seconds'] + info['drift_seconds']:.0f} s, load {info['load_before']} -> {info['load_after']}"
    )
    del torch


def neuron_drift(base: Dict[str, Any], seed: int, quick: bool) -> Dict[str, Any]:
    """FedNLR's Table 4, over every ordered pair of clients (C-1, C-2) instead of one.

    A FedAvg model is trained (same seed and data) until its validation accuracy reaches 88% (the
    paper's "intermediate" model) or 60 rounds pass. For each pair, C-2's *bounded neurons* are the
    hidden neurons whose mean ReLU activation on C-2's data exceeds that on C-1's by at least 0.1;
    then C-1 trains one round (``local_steps`` steps) from that model with FedAvg's client (SGD) or
    FedNLR's (neuron-wise lr scales from C-1's activations), and we record how the bounded neurons'
    mean activation on C-2 changed. The paper's claim: it falls, and less under FedNLR.
    """
    import torch

    from fedopt_kernels.sim import SimConfig, Simulation

    start = time.perf_counter()
    cfg = SimConfig(**{**base, "algorithm": "fedavg", "seed": seed, "client_batched": 1})
    sims = {"fedavg": Simulation(cfg), "fednlr": Simulation(cfg.replace(algorithm="fednlr"))}
    avg = sims["fedavg"]
    acc, t = 0.0, 0
    for t in range(3 if quick else 60):
        rec = avg.run_round(t)
        acc = rec.get("val_acc", acc)
        if acc >= 0.88:
            break
    sims["fednlr"].sync_from(avg)
    snapshot = [p.detach().clone() for p in avg.global_params]

    def hidden(sim: Simulation, x: torch.Tensor) -> torch.Tensor:
        model: Any = sim.model  # typed nn.Module: its submodules are read by name
        net = model.net.net  # ImageClassifier -> OneHiddenMLP -> Sequential(Flatten, Linear, ReLU, Linear)
        with torch.no_grad():
            h = torch.relu(net[1](net[0](model.preprocess(x, train=False))))
        return h.mean(0)

    changes: Dict[str, List[float]] = {"fedavg": [], "fednlr": []}
    bounded_total, pairs = 0, 0
    clients = avg.train_clients
    for c1 in range(len(clients)):
        for c2 in range(len(clients)):
            if c1 == c2:
                continue
            before1, before2 = hidden(avg, clients[c1].train_x), hidden(avg, clients[c2].train_x)
            bounded = (before2 - before1) >= 0.1
            if not bool(bounded.any()):
                continue
            pairs += 1
            bounded_total += int(bounded.sum())
            for name, sim in sims.items():
                with torch.no_grad():
                    for g, p in zip(sim.global_params, snapshot):
                        g.copy_(p)
                sim.load_global()
                opt = sim.strategy.begin(c1, t + 1 + c2)  # a fresh round index per pair: optimizers count rounds
                for _ in range(sim.cfg.local_steps):
                    sim.strategy.local_step(c1, opt, sim.streams[c1].next())
                after2 = hidden(sim, clients[c2].train_x)
                changes[name].append(float((after2 - before2)[bounded].mean()))
    return {
        "seed": seed,
        "model_acc": acc,
        "model_round": t + 1,
        "pairs": pairs,
        "bounded": bounded_total,
        "fedavg": float(np.mean(changes["fedavg"])),
        "fednlr": float(np.mean(changes["fednlr"])),
        "fednlr_smaller_in": int(sum(abs(b) < abs(a) for a, b in zip(changes["fedavg"], changes["fednlr"]))),
        "seconds": time.perf_counter() - start,
    }


# ------------------------------------------------------------------ PAdaMFed: lr robustness, Fashion-MNIST Dir(1)
PADAMFED_LRS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)


def padamfed(args: argparse.Namespace) -> None:
    base = dict(
        dataset="fmnist",
        data_dir=args.fmnist,
        model="mlp",
        partition="dirichlet",
        dirichlet_alpha=1.0,
        clients=50,
        holdout_fraction=0.0,
        clients_per_round=10,
        local_steps=10,
        batch_size=32,
        rounds=3 if args.quick else 30,
        eval_every=30,
        finetune_steps=0,
        split=(0.8, 0.1, 0.1),
        backend="reference",
        device="cpu",
        client_batched=10,
    )
    lrs = PADAMFED_LRS[2:4] if args.quick else PADAMFED_LRS
    settings = {}
    for algo in ("fedavg", "scaffold", "padamfed"):
        for lr in lrs:
            settings[f"{algo} lr={lr}"] = dict(base, algorithm=algo, lr=lr)
    settings["padamfed theory"] = dict(base, algorithm="padamfed")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    name = "padamfed" + (f"-seeds{seeds[0]}-{seeds[-1]}" if seeds != [0] else "")
    runs, info = sweep(name, settings, seeds)
    save(name, {"runs": runs, "timing": info})
    print("| lr | " + " | ".join(("FedAvg", "SCAFFOLD", "PAdaMFed")) + " |\n|---|---|---|---|")
    for lr in lrs:
        cells = [
            mean_std([r["final"]["pooled test acc"] for r in runs[f"{a} lr={lr}"]])
            for a in ("fedavg", "scaffold", "padamfed")
        ]
        print(f"| {lr} | " + " | ".join(cells) + " |")
    th = runs["padamfed theory"]
    print(
        f"PAdaMFed at its theory step sizes (lr {th[0]['hparams']['lr']:.4g}): "
        f"{mean_std([r['final']['pooled test acc'] for r in th])}%"
    )
    print(f"wall {info['wall_seconds']:.0f} s, load {info['load_before']} -> {info['load_after']}")


# ------------------------------------------------------------------ FedNAR: Shakespeare table, scaled down
def fednar(args: argparse.Namespace) -> None:
    base = dict(
        dataset="shakespeare",
        data_dir=args.shakespeare,
        model="char-transformer",
        hidden=32,
        context=40,
        clients=100,
        holdout_fraction=0.0,
        clients_per_round=10,
        local_steps=20,
        batch_size=10,
        lr=args.lr or 0.1,
        round_decay=0.998,
        clip_norm=10.0,
        rounds=2 if args.quick else args.rounds,
        eval_every=10,
        finetune_steps=0,
        split=(0.8, 0.1, 0.1),
        backend="reference",
        device="cpu",
        client_batched=10,
    )
    pairs = [("fedavg", "fednar")] + (
        [] if args.quick else [("fedprox", "fednar-fedprox"), ("scaffold", "fednar-scaffold")][: args.extra_rows]
    )
    settings = {}
    wds = tuple(args.weight_decays)
    for base_algo, nar_algo in pairs:
        for wd in wds:
            settings[f"{base_algo} wd={wd}"] = dict(base, algorithm=base_algo, weight_decay=wd)
            settings[f"{nar_algo} wd={wd}"] = dict(base, algorithm=nar_algo, weight_decay=wd)
    name = "fednar" + (f"-lr{args.lr}" if args.lr else "") + (f"-r{args.rounds}" if args.rounds != 40 else "")
    runs, info = sweep(name, settings, [0])
    save(name, {"runs": runs, "timing": info})
    print(
        "| algorithm | "
        + " | ".join(f"wd {wd} {k}" for wd in wds for k in ("baseline", "FedNAR"))
        + " |\n"
        + "|---" * (1 + 2 * len(wds))
        + "|"
    )
    for base_algo, nar_algo in pairs:
        cells = [
            mean_std([r["final"]["pooled test acc"] for r in runs[f"{a} wd={wd}"]])
            for wd in wds
            for a in (base_algo, nar_algo)
        ]
        print(f"| {base_algo} | " + " | ".join(cells) + " |")
    print(f"wall {info['wall_seconds']:.0f} s, load {info['load_before']} -> {info['load_after']}")


# ------------------------------------------------------------------ FedDecay: new users on Shakespeare roles
FEDDECAY_BETAS = (
    ("FedSGD (β=0)", "fedsgd", None),
    ("FedDecay β=0.25", "feddecay", 0.25),
    ("FedDecay β=0.5", "feddecay", 0.5),
    ("FedAvg (β=1)", "fedavg", None),
)


def feddecay(args: argparse.Namespace) -> None:
    base = dict(
        dataset="shakespeare",
        data_dir=args.shakespeare,
        model="char-transformer",
        hidden=32,
        context=40,
        clients=100,
        holdout_fraction=0.2,
        clients_per_round=10,
        local_steps=20,
        batch_size=10,
        lr=0.5,
        rounds=2 if args.quick else args.rounds,
        eval_every=10,
        finetune_steps=5,
        finetune_lr=0.5,
        split=(0.6, 0.2, 0.2),
        backend="reference",
        device="cpu",
        client_batched=10,
    )
    settings = {
        label: dict(base, algorithm=algo, **({} if beta is None else {"beta": beta}))
        for label, algo, beta in FEDDECAY_BETAS
    }
    seeds = [0] if args.quick else list(range(args.first_seed, args.first_seed + args.seeds))
    name = "feddecay" + (f"-seeds{seeds[0]}-{seeds[-1]}" if seeds != [0] else "")
    runs, info = sweep(name, settings, seeds)
    save(name, {"runs": runs, "timing": info})
    keys = [
        ("new users, fine-tuned: mean", "fine-tuned new mean"),
        ("bottom 10%", "fine-tuned new bottom10%"),
        ("std", "fine-tuned new std"),
        ("existing users, fine-tuned: mean", "fine-tuned existing mean"),
        ("new users, global model", "global new mean"),
    ]
    print("| method | " + " | ".join(k for k, _ in keys) + " |\n" + "|---" * (len(keys) + 1) + "|")
    for label, rs in runs.items():
        print(f"| {label} | " + " | ".join(mean_std([r["final"][m] for r in rs]) for _, m in keys) + " |")
    print(f"wall {info['wall_seconds']:.0f} s, load {info['load_before']} -> {info['load_after']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=("fednlr", "padamfed", "fednar", "feddecay"))
    p.add_argument("--mnist", help="MNIST folder (IDX files)")
    p.add_argument("--fmnist", help="Fashion-MNIST folder (IDX files)")
    p.add_argument("--shakespeare", help="Shakespeare folder (LEAF JSON, from build_shakespeare)")
    p.add_argument("--rounds", type=int, default=40, help="fednar/feddecay rounds (default %(default)s)")
    p.add_argument("--seeds", type=int, default=1, help="feddecay, padamfed: seeds (default %(default)s)")
    p.add_argument("--first-seed", type=int, default=0, help="padamfed, feddecay: the first seed (default %(default)s)")
    p.add_argument("--extra-rows", type=int, default=0, help="fednar: also FedProx (1) and SCAFFOLD (2) rows")
    p.add_argument(
        "--lr", type=float, help="fednar: client lr instead of the paper's 0.1 (results go to fednar-lr<LR>.json)"
    )
    p.add_argument("--weight-decays", type=float, nargs="+", default=[1e-4, 1e-3], help="fednar (default %(default)s)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:  # a smoke test: keep the committed results
        global OUT
        OUT = Path(tempfile.gettempdir()) / "fedopt-real-quick"
    need = {"fednlr": "mnist", "padamfed": "fmnist", "fednar": "shakespeare", "feddecay": "shakespeare"}
    if getattr(args, need[args.experiment]) is None:
        p.error(f"{args.experiment} needs --{need[args.experiment]} DIR (bash experiments/get_data.sh)")
    {"fednlr": fednlr, "padamfed": padamfed, "fednar": fednar, "feddecay": feddecay}[args.experiment](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
