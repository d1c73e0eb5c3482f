"""The third round of comparisons (experiments/protocol_iii.md): FedNAR on six backbones, FedNova
under uneven work, accuracy against epsilon under user-level DP.

    python experiments/run_iii.py all --jobs 2            # the pilot, then the four experiments in order
    python experiments/run_iii.py iii-fednova --jobs 2    # one of them
    python experiments/run_iii.py all --quick --dataset digits --out /tmp/x   # a smoke run

Runs, resumption, provenance, summaries and verdicts are run_protocol.py's (``run_experiment``);
this file only declares the experiments. Every run is written to ``OUT/<experiment>/runs/`` as it
ends; ``OUT`` defaults to ``experiments/protocol_iii``. The report is ``experiments/report_iii.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import run_protocol as rp  # noqa: E402
from provenance import provenance, stamp, utc_now  # noqa: E402

SCRIPT = "experiments/run_iii.py"
OUT = HERE / "protocol_iii"
LR = 0.1  # every method's client lr (protocol_iii.md: protocol.md §3's pick at weight decay 0.01)
WDS = (0.01, 0.1)  # good, too high
ALPHAS = (0.3, 10.0)
# Table A's experiments: (name, alpha, weight decays); alpha 10 in two, the good weight decay first
# (protocol_iii.md, amended after the first runs showed the machine's load)
TABLE_A: Tuple[Tuple[str, float, Tuple[float, ...]], ...] = (
    ("iii-fednar-a0.3", 0.3, WDS),
    ("iii-fednar-a10", 10.0, (0.01,)),
    ("iii-fednar-a10-wd0.1", 10.0, (0.1,)),
)
UNCLIPPED = 1e6  # FedNAR with this max norm is SGD with weight decay: the pilot's log reads ||g + wd x||
# (label, baseline algorithm, FedNAR algorithm, settings both share)
BACKBONES: Tuple[Tuple[str, str, str, Dict[str, Any]], ...] = (
    ("FedAvg", "fedavg", "fednar", {}),
    ("FedProx", "fedprox", "fednar-fedprox", {"prox_mu": 0.01}),
    ("SCAFFOLD", "scaffold", "fednar-scaffold", {}),
    ("FedExP", "fedavg", "fednar", {"server_optimizer": "exp", "server_eps": 1e-3}),
    (
        "FedAdam",
        "fedavg",
        "fednar",
        {"server_optimizer": "adam", "server_lr": 0.01, "server_beta1": 0.9, "server_beta2": 0.99, "server_tau": 1e-3},
    ),
    ("FedAvgM", "fedavg", "fednar", {"server_optimizer": "avgm", "server_lr": 1.0, "server_momentum": 0.9}),
)
# FedNAR, Table 1 (CIFAR-10, ResNet-18): (baseline, FedNAR) at alpha 0.3 and alpha 10
PAPER_TABLE_1 = {
    "FedAvg": {0.3: (85.19, 87.64), 10.0: (89.45, 90.23)},
    "FedProx": {0.3: (85.02, 87.45), 10.0: (89.37, 90.38)},
    "SCAFFOLD": {0.3: (86.89, 89.17), 10.0: (90.64, 91.85)},
    "FedExP": {0.3: (86.46, 88.55), 10.0: (88.82, 89.69)},
    "FedAdam": {0.3: (84.12, 85.81), 10.0: (88.86, 89.56)},
    "FedAvgM": {0.3: (90.33, 90.43), 10.0: (92.19, 91.15)},
}
# Table B's work settings (protocol_iii.md): equal steps, steps drawn from 2..40, half the clients straggling
WORK: Tuple[Tuple[str, Dict[str, Any]], ...] = (
    ("equal", {}),
    ("range", {"local_steps_range": (2, 40)}),
    ("stragglers", {"stragglers": 0.5}),
)
NOVA_METHODS: Tuple[Tuple[str, str, Dict[str, Any]], ...] = (
    ("FedAvg", "fedavg", {}),
    ("FedProx", "fedprox", {"prox_mu": 0.01}),
    ("FedNova", "fednova", {}),
)
EPSILONS = (1.0, 4.0, 8.0, math.inf)
DP = {"dp_clip": 1.0, "dp_adaptive_quantile": 0.5, "dp_clip_lr": 0.2, "dp_accountant": "rdp"}
# Adaptive clipping needs 2 sigma_b > z (docs/privacy.md), sigma_b = 20 expected clients / 20 = 1; epsilon 1
# in 40 rounds needs z = 3.18: those runs keep the clip fixed at DP's initial 1.0 (protocol_iii.md, amended)
FIXED_CLIP_EPSILONS = (1.0,)
ADAPTIVE_ONLY = ("dp_adaptive_quantile", "dp_clip_lr")


def paper_cell(backbone: str, alpha: float) -> str:
    """The paper's Table 1 pair for one backbone and alpha: "FedNAR vs baseline"."""
    baseline, nar = PAPER_TABLE_1[backbone][alpha]
    return f"{nar:.2f} vs {baseline:.2f}"


def base(dataset: str, data_dir: Optional[str]) -> Dict[str, Any]:
    """The SimConfig fields every run of this round shares."""
    return dict(
        dataset=dataset,
        data_dir=data_dir if dataset != "digits" else None,
        model="mlp",
        backend="reference",
        device="cpu",
        client_batched=20,
        formulations="default",
        partition="dirichlet",
        dirichlet_alpha=0.3,
        clients=100,
        clients_per_round=20,
        local_steps=20,
        batch_size=32,
        rounds=40,
        eval_every=40,
        lr=LR,
        round_decay=0.998,
        split=(0.8, 0.1, 0.1),
        holdout_fraction=0.0,
        finetune_steps=0,
    )


def _fmt(v: float) -> str:
    return "inf" if v == math.inf else f"{v:g}"


def nar_key(algo: str, fixed: Dict[str, Any], wd: float) -> str:
    server = fixed.get("server_optimizer")
    return f"{algo}{'-' + server if server else ''}_wd{_fmt(wd)}"


def fednar_methods(pilot: Dict[str, Any], wds: Sequence[float] = WDS) -> rp.Grids:
    """Table A: per backbone and weight decay, the baseline (clipping g) and FedNAR (co-clipping g + wd x)."""
    out: rp.Grids = {}
    for label, base_algo, nar_algo, fixed in BACKBONES:
        for wd in wds:
            for name, algo in ((label, base_algo), (f"FedNAR-{label}", nar_algo)):
                cfg = dict(algorithm=algo, weight_decay=wd, clip_norm=pilot["max_norm"], **fixed)
                out[f"{name} wd={_fmt(wd)}"] = {nar_key(algo, fixed, wd): cfg}
    return out


def fednova_methods(pilot: Dict[str, Any]) -> rp.Grids:
    """Table B: FedAvg, FedProx and FedNova in each work setting."""
    return {
        f"{label} {work}": {f"{algo}_{work}": dict(algorithm=algo, **fixed, **extra)}
        for work, extra in WORK
        for label, algo, fixed in NOVA_METHODS
    }


def dp_methods(pilot: Dict[str, Any]) -> rp.Grids:
    """Figure C: FedAvg (clipping g) and FedNAR at weight decay 0.01, at each epsilon (inf: no DP)."""
    out: rp.Grids = {}
    for eps in EPSILONS:
        dp = {} if eps == math.inf else dict(DP, dp_target_epsilon=eps)
        if eps in FIXED_CLIP_EPSILONS:
            dp = {k: v for k, v in dp.items() if k not in ADAPTIVE_ONLY}
        for label, algo in (("FedAvg", "fedavg"), ("FedNAR", "fednar")):
            cfg = dict(algorithm=algo, clip_norm=pilot["max_norm"], **dp)
            out[f"{label} eps={_fmt(eps)}"] = {f"{algo}_eps{_fmt(eps)}": cfg}
    return out


# ------------------------------------------------------------------ the pilot (Table A's max norm)
def pilot(exp: rp.Experiment, args: argparse.Namespace) -> Dict[str, Any]:
    """The max norm and the clipping it causes, computed once (``OUT/pilot.json``) for every experiment."""
    path = Path(args.out) / "pilot.json"
    if path.exists():
        return {k: v for k, v in json.loads(path.read_text()).items() if k != "provenance"}
    started = utc_now()
    rounds = 1 if args.quick else 10
    cfg = dict(exp.base, client_batched=1, rounds=rounds, eval_every=rounds, seed=rp.PILOT_SEED, dirichlet_alpha=0.3)
    first = dict(cfg, algorithm="fednar", weight_decay=0.01, clip_norm=UNCLIPPED)
    r = rp.measure("norms", first, {})
    max_norm = float(f"{r['norm_median']:.3g}")
    checks = {}
    for name, algo, wd, alpha in (
        ("FedNAR wd=0.01 a=0.3", "fednar", 0.01, 0.3),
        ("FedNAR wd=0.1 a=0.3", "fednar", 0.1, 0.3),
        ("FedNAR wd=0.01 a=10", "fednar", 0.01, 10.0),
        ("FedAvg wd=0.01 a=0.3", "fedavg", 0.01, 0.3),
    ):
        c = rp.measure(
            "norms", dict(cfg, algorithm=algo, weight_decay=wd, clip_norm=max_norm, dirichlet_alpha=alpha), {}
        )
        checks[name] = {k: c[k] for k in ("clipped_fraction", "norm_median", "norm_steps", "seconds")}
    out = {
        "max_norm": max_norm,
        "pilot_norm_median": r["norm_median"],
        "pilot_steps": r["norm_steps"],
        "pilot_seconds": r["seconds"],
        "pilot_config": first,
        "clipping": checks,
    }
    prov = provenance(args.device, args.argv, exclude=[Path(args.out)], script=SCRIPT)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(out, provenance=stamp(prov, started, utc_now())), indent=1, default=float) + "\n")
    return out


# ------------------------------------------------------------------ FedNova's one-round aggregate
def one_round(exp: rp.Experiment, args: argparse.Namespace) -> Dict[str, Any]:
    """One FedAvg and one FedNova round from the same start with equal steps (Table B's control):
    the largest parameter difference, beside float32's rounding of the parameters (eps32 * |x|)."""
    import torch

    from fedopt_kernels.sim import SimConfig, Simulation

    torch.set_num_threads(1)
    started = utc_now()
    models = {}
    for algo in ("fedavg", "fednova"):
        sim = Simulation(SimConfig(**dict(exp.base, algorithm=algo, rounds=1, eval_every=1, seed=0)))
        start = [p.detach().clone() for p in sim.global_params]
        sim.run_round(0)
        models[algo] = [p.detach().clone() for p in sim.global_params]
    eps32 = torch.finfo(torch.float32).eps
    diff = max(float((a - b).abs().max()) for a, b in zip(models["fedavg"], models["fednova"]))
    ratio = max(
        float(((a - b).abs() / (eps32 * a.abs()).clamp_min(torch.finfo(torch.float32).tiny)).max())
        for a, b in zip(models["fedavg"], models["fednova"])
    )
    update = max(float((a - s).abs().max()) for a, s in zip(models["fedavg"], start))
    out = {
        "max_abs_diff": diff,
        "max_diff_in_eps32_x": ratio,  # max over elements of |x_nova - x_avg| / (eps32 |x_avg|)
        "max_abs_update": update,
        "max_abs_param": max(float(a.abs().max()) for a in models["fedavg"]),
        "bitwise_equal": all(torch.equal(a, b) for a, b in zip(models["fedavg"], models["fednova"])),
        "config": dict(exp.base, rounds=1, seed=0),
    }
    prov = provenance(args.device, args.argv, exclude=[Path(args.out)], script=SCRIPT)
    path = Path(args.out) / exp.name / "one_round.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(out, provenance=stamp(prov, started, utc_now())), indent=1, default=float) + "\n")
    return out


def experiments(dataset: str, data_dir: Optional[str]) -> Dict[str, rp.Experiment]:
    """The experiments of protocol_iii.md, in their running order."""
    b = base(dataset, data_dir)
    acc = "pooled test accuracy (%)"
    out: Dict[str, rp.Experiment] = {}
    for name, alpha, wds in TABLE_A:
        out[name] = rp.Experiment(
            name,
            dict(b, dirichlet_alpha=alpha),
            functools.partial(fednar_methods, wds=wds),
            [(f"FedNAR-{lb} wd={_fmt(wd)}", f"{lb} wd={_fmt(wd)}", +1, "select") for lb, *_ in BACKBONES for wd in wds],
            "test_acc",
            acc,
            pilot=pilot,
            paper={
                f"FedNAR-{lb} wd={_fmt(wd)} vs {lb} wd={_fmt(wd)}": paper_cell(lb, alpha)
                for lb, *_ in BACKBONES
                for wd in wds
            },
        )
        if alpha == ALPHAS[0]:
            out["iii-fednova"] = rp.Experiment(
                "iii-fednova",
                b,
                fednova_methods,
                [(f"FedNova {w}", f"{m} {w}", +1, "select") for w, _ in WORK for m in ("FedAvg", "FedProx")],
                "test_acc",
                acc,
            )
            out["iii-dp"] = rp.Experiment(
                "iii-dp",
                dict(b, sampling="poisson", sample_rate=0.2, clients_per_round=None, weight_decay=0.01),
                dp_methods,
                [(f"FedNAR eps={_fmt(e)}", f"FedAvg eps={_fmt(e)}", +1, "select") for e in EPSILONS],
                "test_acc",
                acc,
                pilot=pilot,
            )
    order = ["iii-fednar-a0.3", "iii-fednova", "iii-dp", "iii-fednar-a10", "iii-fednar-a10-wd0.1"]
    return {k: out[k] for k in order}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    names = list(experiments("digits", None))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=names + ["all"])
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (default %(default)s)")
    p.add_argument("--out", default=str(OUT), help="results folder (default experiments/protocol_iii)")
    p.add_argument("--data-dir", default=rp.FMNIST, help="Fashion-MNIST's folder (default %(default)s)")
    p.add_argument("--dataset", default="fmnist", choices=("fmnist", "digits"), help="digits: a smoke test")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="paired seeds (default 0 1 2 3 4)")
    p.add_argument("--no-run", action="store_true", help="train nothing: summarise the seeds on disk")
    p.add_argument("--quick", action="store_true", help="1 seed, 1 round, 3 local steps")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    if args.seeds is not None and (len(set(args.seeds)) != len(args.seeds) or rp.PILOT_SEED in args.seeds):
        p.error(f"--seeds must be distinct and exclude the pilots' seed {rp.PILOT_SEED}")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.device, args.mix_commits, args.script = "cpu", False, SCRIPT
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    exps = experiments(args.dataset, args.data_dir)
    seeds: List[int] = list(args.seeds if args.seeds is not None else rp.SEEDS)
    for name in list(exps) if args.experiment == "all" else [args.experiment]:
        exp = rp.quick_version(exps[name]) if args.quick else exps[name]
        if name == "iii-fednova" and not args.no_run:
            one_round(exp, args)
        # the first three seeds, then the rest: a run cut short leaves whole seeds (the cut rule)
        for part in [seeds] if args.no_run or len(seeds) <= 3 else [seeds[:3], seeds]:
            args.seeds = part
            rp.run_experiment(exp, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
