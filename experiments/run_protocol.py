"""The five comparisons of experiments/protocol.md, one command each, every seed.

    python experiments/run_protocol.py feddecay        # or fednlr-shards, fednlr-dir, fednar, padamfed, feddyn
    python experiments/run_protocol.py fednar --jobs 2 # runs in 2 processes (numbers unchanged)
    python experiments/run_protocol.py all             # the six, one after another
    python experiments/run_protocol.py feddyn --quick --out /tmp/x   # 1 seed, 1 round, 1 point per method

Every run (one grid point of one method on one seed) is written to
``OUT/<experiment>/runs/<point>__s<seed>.json`` as soon as it finishes, and a rerun skips the runs
already there (an interrupted command resumes). At the end the runs are summarised by the
protocol's rules into ``OUT/<experiment>.json`` and ``OUT/<experiment>.md``: per seed, each
method's grid point with the best validation score, its test metric, the paired differences and
the verdict. ``OUT`` defaults to ``experiments/protocol``. Every run uses one torch thread; run
the command under ``nice -n 19`` on a shared machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

FMNIST = "/usr/share/datasets/fashion-mnist"
SEEDS = (0, 1, 2, 3, 4)
PILOT_SEED = 1000  # a seed no comparison uses
L9 = tuple(round(0.03 * 10 ** (k / 8), 6) for k in range(9))  # 0.03 ... 0.3, eighth decades
L3 = (L9[0], L9[4], L9[8])  # 0.03, 0.0949, 0.3 (a subset of L9)


@dataclasses.dataclass
class Experiment:
    """What one comparison runs and how its runs become a verdict (experiments/protocol.md)."""

    name: str
    base: Dict[str, Any]  # the SimConfig fields every run shares
    methods: Callable[[Dict[str, Any]], Dict[str, Dict[str, Dict[str, Any]]]]  # pilot -> method -> point -> overrides
    # (method, baseline or None: against zero, paper's sign, "select" | "sweep_mean" | an extra)
    comparisons: Sequence[Tuple[str, Optional[str], int, str]]
    metric: str  # the compared test metric
    metric_label: str
    lower_is_better: bool = False
    kind: str = "final"  # how a run is measured: "final", "newusers", "curve", "norms"
    pilot: Optional[Callable[[Experiment, argparse.Namespace], Dict[str, Any]]] = None
    paper: Dict[str, str] = dataclasses.field(default_factory=dict)  # comparison label -> the paper's number
    digits: int = 2  # decimals the tables show


# ------------------------------------------------------------------ one run
def measure(kind: str, cfg: Dict[str, Any], pilot: Dict[str, Any]) -> Dict[str, Any]:
    """Train one configuration and return the numbers the protocol reads (val score, test metrics)."""
    import torch

    from fedopt_kernels.sim import SimConfig, Simulation
    from fedopt_kernels.sim.evaluate import pooled_metrics

    torch.set_num_threads(1)
    start = time.perf_counter()
    if kind == "drift":
        return dict(drift_run(cfg), seconds=time.perf_counter() - start)
    sim = Simulation(SimConfig(**cfg))
    out: Dict[str, Any] = {}
    norms: List[Any] = []  # 0-d tensors: no host sync per step
    if kind == "norms":  # log the norm each local step clips against (sequential clients only)
        wd, combined = cfg.get("weight_decay", 0.0), cfg["algorithm"].startswith("fednar")
        original = sim.strategy.loss_and_grad

        def logged(batch):
            loss = original(batch)
            with torch.no_grad():
                parts = [(p.grad + wd * p if combined else p.grad).double().norm() for p in sim.model.parameters()]
                norms.append(torch.stack(parts).norm())
            return loss

        sim.strategy.loss_and_grad = logged  # type: ignore[method-assign]  # logs each gradient's norm
    curve_val, curve_test = [], []
    for t in range(cfg["rounds"]):
        rec = sim.run_round(t)
        if kind == "curve":
            curve_val.append(rec["val_acc"])
            curve_test.append(pooled_metrics(sim.model, sim.train_clients, "test")["acc"])
    final = sim.final_evaluation()
    out["test_acc"] = final["pooled_test_acc"]
    out["val_acc"] = sim.history[-1].get("val_acc")
    out["train_loss"] = sim.history[-1]["train_loss"]
    out["val_score"] = out["val_acc"]
    if kind == "newusers":
        out["new_finetuned_test"] = final["finetuned"]["new"]["mean"]
        out["new_global_test"] = final["global"]["new"]["mean"]
        out["existing_finetuned_test"] = final["finetuned"]["existing"]["mean"]
        out["val_score"] = out["new_finetuned_val"] = newusers_val(sim)
    if kind == "curve":
        target = pilot["target"]

        def first(c):
            return next((i + 1 for i, a in enumerate(c) if a >= target), cfg["rounds"] + 1)

        out.update(
            rounds_val=first(curve_val),
            rounds_test=first(curve_test),
            curve_val=curve_val,
            curve_test=curve_test,
            reached=first(curve_test) <= cfg["rounds"],
        )
        out["val_score"] = [-out["rounds_val"], curve_val[-1]]  # fewer rounds; ties: higher final accuracy
    if kind == "norms":
        a = torch.stack(norms).cpu().numpy() if norms else np.zeros(0)
        max_norm = cfg.get("clip_norm")
        out.update(
            norm_median=float(np.median(a)),
            norm_steps=int(a.size),
            clipped_fraction=None if max_norm is None else float((a > max_norm).mean()),
        )
        if pilot.get("keep_norms"):
            out["norms"] = a.tolist()
    out["seconds"] = time.perf_counter() - start
    return out


DRIFT_TARGET = 0.70  # the intermediate model's validation accuracy (protocol §6)
DRIFT_ROUNDS = 60


def drift_run(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Protocol §6 for one method and seed: the intermediate FedAvg model, then for every ordered
    client pair (C-1, C-2) the change of C-2's bounded neurons' activation on C-2's data after C-1
    takes one round's local steps with the method's client (``drift_client``)."""
    import torch

    from fedopt_kernels.sim import SimConfig, Simulation
    from fedopt_kernels.sim.models.small import OneHiddenMLP

    cfg = dict(cfg)
    client = cfg.pop("drift_client")
    own = {k: cfg.pop(k) for k in list(cfg) if k.startswith("nlr_")}  # FedNLR's settings: FedAvg refuses them
    avg = Simulation(SimConfig(**dict(cfg, algorithm="fedavg")))
    acc, t = 0.0, 0
    for t in range(cfg["rounds"]):
        acc = avg.run_round(t).get("val_acc", acc)
        if acc >= DRIFT_TARGET:
            break
    sim = avg
    if client != "fedavg":
        sim = Simulation(SimConfig(**dict(cfg, **own, algorithm=client)))
        sim.sync_from(avg)
    snapshot = [p.detach().clone() for p in avg.global_params]

    mlp = next(m for m in sim.model.modules() if isinstance(m, OneHiddenMLP))
    preprocess = getattr(sim.model, "preprocess", None)  # an ImageClassifier wrapping it normalises first

    def hidden(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = preprocess(x, train=False) if preprocess is not None else x
            return torch.relu(mlp.net[1](mlp.net[0](x))).mean(0)

    clients = sim.train_clients
    changes: List[float] = []
    bounded_total = 0
    for c1 in range(len(clients)):
        for c2 in range(len(clients)):
            if c1 == c2:
                continue
            with torch.no_grad():
                for g, p in zip(sim.global_params, snapshot):
                    g.copy_(p)
            sim.load_global()
            before1, before2 = hidden(clients[c1].train_x), hidden(clients[c2].train_x)
            bounded = (before2 - before1) >= 0.1
            if not bool(bounded.any()):
                continue
            bounded_total += int(bounded.sum())
            opt = sim.strategy.begin(c1, t + 1 + c2)  # a fresh round index per pair: optimizers count rounds
            for _ in range(sim.cfg.local_steps):
                sim.strategy.local_step(c1, opt, sim.streams[c1].next())
            changes.append(float((hidden(clients[c2].train_x) - before2)[bounded].mean()))
    a = np.asarray(changes, dtype=np.float64)
    return {
        "change": float(a.mean()) if a.size else float("nan"),
        "drift_size": float(np.abs(a).mean()) if a.size else float("nan"),
        "pairs": int(a.size),
        "bounded": bounded_total,
        "model_round": t + 1,
        "model_val_acc": acc,
        "pair_changes": a.tolist(),
        "val_score": 0.0,
    }


def newusers_val(sim) -> float:
    """New users' mean accuracy on their validation split after the protocol's fine-tuning.

    Each new user fine-tunes the global model as in ``final_evaluation`` (its train split, the
    run's finetune steps and lr), from a fine-tuning stream of its own seed; users count equally."""
    import torch

    from fedopt_kernels.fl.client_round import loss_and_correct
    from fedopt_kernels.sim.data.clients import BatchStream
    from fedopt_kernels.sim.evaluate import finetune

    users = [u for u in sim.data.new_clients if u.val_y.shape[0] > 0]
    seeds = np.random.SeedSequence([sim.cfg.seed, 17]).spawn(len(users))
    accs = []
    for u, s in zip(users, seeds):
        sim.load_global()
        stream = BatchStream(u.train_x, u.train_y, sim.cfg.batch_size, np.random.default_rng(s))
        finetune(sim.model, u, sim.cfg.finetune_steps, sim.cfg.finetune_lr, stream)
        accs.append(loss_and_correct(sim.model, u.val_x, u.val_y)[1] / u.val_y.shape[0])
    sim.load_global()
    del torch
    return float(np.mean(accs))


def _worker(job: Tuple[str, Dict[str, Any], Dict[str, Any], str]) -> Tuple[str, float]:
    kind, cfg, pilot, path = job
    result = measure(kind, cfg, pilot)
    Path(path).write_text(json.dumps({"config": cfg, **result}, default=float) + "\n")
    return path, result["seconds"]


# ------------------------------------------------------------------ the experiments
def _fmt(v: float) -> str:
    return f"{v:.4g}"


def feddecay_methods(pilot: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    decay = {
        f"beta{b}_lr{_fmt(lr)}": dict(algorithm="feddecay", beta=b, lr=lr, finetune_lr=lr)
        for b in (0.25, 0.5, 0.75)
        for lr in L3
    }
    avg = {f"fedavg_lr{_fmt(lr)}": dict(algorithm="fedavg", lr=lr, finetune_lr=lr) for lr in L9}
    return {"FedDecay": decay, "FedAvg": avg}


def fednlr_methods(pilot: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    nlr = {
        f"fednlr_mu{m}_lr{_fmt(lr)}": dict(algorithm="fednlr", nlr_mu0=m, lr=lr) for m in (0.5, 1.0, 2.0) for lr in L3
    }
    avg = {f"fedavg_lr{_fmt(lr)}": dict(algorithm="fedavg", lr=lr) for lr in L9}
    return {"FedNLR": nlr, "FedAvg": avg}


FEDNAR_BACKBONES = (
    ("FedAvg", "fedavg", "fednar"),
    ("FedProx", "fedprox", "fednar-fedprox"),
    ("SCAFFOLD", "scaffold", "fednar-scaffold"),
)
FEDNAR_WDS = (0.01, 0.1)
# protocol.md 3: 0.3 added after every method chose 0.1, the first grid's top, at weight decay 0.01
FEDNAR_LRS = (0.03, 0.1, 0.3)


def fednar_methods(pilot: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    out = {}
    for label, base_algo, nar_algo in FEDNAR_BACKBONES:
        for wd in FEDNAR_WDS:
            for name, algo in ((label, base_algo), (f"FedNAR-{label}", nar_algo)):
                out[f"{name} wd={wd}"] = {
                    f"{algo}_wd{wd}_lr{lr}": dict(algorithm=algo, weight_decay=wd, lr=lr, clip_norm=pilot["max_norm"])
                    for lr in FEDNAR_LRS
                }
    return out


def fednar_pilot(exp: Experiment, args: argparse.Namespace) -> Dict[str, Any]:
    cfg = dict(exp.base, algorithm="fedavg", weight_decay=0.01, lr=0.1, rounds=1 if args.quick else 10, seed=PILOT_SEED)
    r = measure(exp.kind, cfg, {})
    return {
        "max_norm": float(f"{r['norm_median']:.3g}"),
        "pilot_config": cfg,
        "pilot_steps": r["norm_steps"],
        "pilot_seconds": r["seconds"],
    }


PADAM_C = (0.1, 0.316, 1.0, 3.16, 10.0)
PADAM_LRS = (0.01, 0.0316, 0.1, 0.316, 1.0)
# protocol.md 4, (a') only: the next half decade of each sweep, after tuned PAdaMFed chose c = 10
PADAM_C_MORE, PADAM_LR_MORE = 31.6, 3.16


def padamfed_methods(pilot: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    eta, gamma = pilot["eta"], pilot["gamma"]

    def padam(c: float) -> Dict[str, Any]:
        return dict(algorithm="padamfed", lr=eta * c, server_lr=gamma * c)

    sweep = {f"padamfed_c{c}": padam(c) for c in PADAM_C}
    fedavg = {f"fedavg_lr{lr}": dict(algorithm="fedavg", lr=lr) for lr in PADAM_LRS}
    scaffold = {f"scaffold_lr{lr}": dict(algorithm="scaffold", lr=lr) for lr in PADAM_LRS}
    return {
        "PAdaMFed (theory)": {"padamfed_c1.0": sweep["padamfed_c1.0"]},
        "PAdaMFed (tuned)": sweep,
        "FedAvg": fedavg,
        "SCAFFOLD": scaffold,
        # (a'): one more half decade for every method
        "PAdaMFed (tuned, 6)": dict(sweep, **{f"padamfed_c{PADAM_C_MORE}": padam(PADAM_C_MORE)}),
        "FedAvg (6)": dict(fedavg, **{f"fedavg_lr{PADAM_LR_MORE}": dict(algorithm="fedavg", lr=PADAM_LR_MORE)}),
        "SCAFFOLD (6)": dict(scaffold, **{f"scaffold_lr{PADAM_LR_MORE}": dict(algorithm="scaffold", lr=PADAM_LR_MORE)}),
    }


def padamfed_pilot(exp: Experiment, args: argparse.Namespace) -> Dict[str, Any]:
    from fedopt_kernels import theory_hparams

    b = exp.base
    eta, gamma, beta = theory_hparams(b["clients_per_round"], b["local_steps"], b["rounds"])
    return {"eta": eta, "gamma": gamma, "beta": beta}


def drift_methods(pilot: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    return {
        "FedAvg": {"fedavg": dict(drift_client="fedavg")},
        **{f"FedNLR mu0={m}": {f"fednlr_mu{m}": dict(drift_client="fednlr", nlr_mu0=m)} for m in (0.5, 2.0)},
    }


# 0.03 ... 0.1, then (protocol.md 5, amended after FedDyn and FedAvg chose 0.1) 0.144, 0.208, 0.3
FEDDYN_LRS = tuple(round(0.03 * (10 / 3) ** (k / 5), 6) for k in range(6)) + tuple(
    round(0.1 * 3 ** (k / 3), 6) for k in range(1, 4)
)


def feddyn_methods(pilot: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    return {
        "FedDyn": {
            f"feddyn_a{a}_lr{lr}": dict(algorithm="feddyn", dyn_alpha=a, lr=lr)
            for a in (0.1, 0.01, 0.001)
            for lr in (0.03, 0.1, 0.3)
        },
        "FedAvg": {f"fedavg_lr{_fmt(lr)}": dict(algorithm="fedavg", lr=lr) for lr in FEDDYN_LRS},
        "SCAFFOLD": {f"scaffold_lr{_fmt(lr)}": dict(algorithm="scaffold", lr=lr) for lr in FEDDYN_LRS},
    }


def feddyn_pilot(exp: Experiment, args: argparse.Namespace) -> Dict[str, Any]:
    cfg = dict(exp.base, algorithm="fedavg", lr=0.1, seed=PILOT_SEED)
    r = measure(exp.kind, cfg, {"target": 2.0})  # an unreachable target: only the curve is wanted
    best = max(r["curve_val"])
    return {
        "target": math.floor(90 * best) / 100,
        "pilot_best_val": best,
        "pilot_config": cfg,
        "pilot_seconds": r["seconds"],
    }


def experiments(
    dataset: str, data_dir: Optional[str], device: str = "cpu", client_parallel: int = 1
) -> Dict[str, Experiment]:
    """The six comparisons; ``device``/``client_parallel`` only change where and how clients train."""
    data = dict(
        dataset=dataset,
        data_dir=data_dir if dataset != "digits" else None,
        model="mlp",
        backend="reference",
        device=device,
        client_parallel=client_parallel,
        partition="dirichlet",
        split=(0.8, 0.1, 0.1),
        holdout_fraction=0.0,
        finetune_steps=0,
    )
    exps = [
        Experiment(
            "feddecay",
            dict(
                data,
                dirichlet_alpha=0.4,
                clients=50,
                holdout_fraction=0.2,
                split=(0.6, 0.2, 0.2),
                clients_per_round=8,
                local_steps=24,
                decay_every=8,
                batch_size=32,
                rounds=60,
                eval_every=60,
                finetune_steps=8,
            ),
            feddecay_methods,
            [("FedDecay", "FedAvg", +1, "select")],
            "new_finetuned_test",
            "new users' mean test accuracy after fine-tuning (%)",
            kind="newusers",
            paper={"FedDecay vs FedAvg": "FEMNIST 91.52 vs 90.55 (Table 3)"},
        ),
        Experiment(
            "fednlr-shards",
            dict(
                data,
                partition="shards",
                shards_per_client=2,
                clients=20,
                clients_per_round=8,
                local_steps=20,
                batch_size=64,
                rounds=40,
                eval_every=40,
            ),
            fednlr_methods,
            [("FedNLR", "FedAvg", +1, "select")],
            "test_acc",
            "pooled test accuracy (%)",
            paper={"FedNLR vs FedAvg": "CIFAR-10 Shards(100, 4): 73.38 vs 72.94 (Table 3)"},
        ),
        Experiment(
            "fednlr-dir",
            dict(
                data,
                dirichlet_alpha=0.05,
                clients=20,
                clients_per_round=8,
                local_steps=20,
                batch_size=64,
                rounds=40,
                eval_every=40,
            ),
            fednlr_methods,
            [("FedNLR", "FedAvg", +1, "select")],
            "test_acc",
            "pooled test accuracy (%)",
            paper={"FedNLR vs FedAvg": "CIFAR-10 Dir(0.1): 63.40 vs 63.30 (Table 3)"},
        ),
        # the norm log hooks the sequential local step: FedNAR's clients train one after another
        Experiment(
            "fednar",
            dict(
                data,
                client_parallel=1,
                dirichlet_alpha=0.3,
                clients=100,
                clients_per_round=10,
                local_steps=20,
                batch_size=32,
                rounds=50,
                eval_every=50,
                round_decay=0.998,
            ),
            fednar_methods,
            [
                (f"FedNAR-{b} wd={wd}", f"{b} wd={wd}", +1, "select")
                for b, _, _ in FEDNAR_BACKBONES
                for wd in FEDNAR_WDS
            ],
            "test_acc",
            "pooled test accuracy (%)",
            kind="norms",
            pilot=fednar_pilot,
            paper={
                f"FedNAR-{b} wd={wd} vs {b} wd={wd}": p
                for (b, _, _), p in zip(
                    FEDNAR_BACKBONES, ("CIFAR-10 Dir(0.3): 87.64 vs 85.19", "87.45 vs 85.02", "89.17 vs 86.89")
                )
                for wd in FEDNAR_WDS
            },
        ),
        Experiment(
            "padamfed",
            dict(
                data,
                dirichlet_alpha=0.5,
                clients=50,
                clients_per_round=10,
                local_steps=10,
                batch_size=32,
                rounds=150,
                eval_every=150,
            ),
            padamfed_methods,
            [
                ("PAdaMFed (theory)", "FedAvg", +1, "select"),
                ("PAdaMFed (theory)", "SCAFFOLD", +1, "select"),
                ("PAdaMFed (tuned, 6)", "FedAvg (6)", +1, "select"),
                ("PAdaMFed (tuned, 6)", "SCAFFOLD (6)", +1, "select"),
                ("PAdaMFed (tuned)", "FedAvg", +1, "sweep_mean"),
                ("PAdaMFed (tuned)", "SCAFFOLD", +1, "sweep_mean"),
            ],
            "test_acc",
            "pooled test accuracy (%)",
            pilot=padamfed_pilot,
            paper={"PAdaMFed (theory) vs FedAvg": "figures only (EMNIST): matches or beats tuned baselines"},
        ),
        Experiment(
            "feddyn",
            dict(
                data,
                dirichlet_alpha=0.05,
                clients=50,
                clients_per_round=10,
                local_steps=10,
                batch_size=32,
                rounds=100,
                eval_every=1,
            ),
            feddyn_methods,
            [("FedDyn", "FedAvg", -1, "select"), ("FedDyn", "SCAFFOLD", -1, "select")],
            "rounds_test",
            "rounds to the target test accuracy",
            lower_is_better=True,
            kind="curve",
            pilot=feddyn_pilot,
            paper={"FedDyn vs FedAvg": "fewer rounds to target (Acar et al. 2021)"},
        ),
        # clients take their local steps one at a time here: the drift hooks the sequential step
        Experiment(
            "fednlr-drift",
            dict(
                data,
                client_parallel=1,
                model="mlp1",
                hidden=25,
                partition="classes",
                clients=10,
                clients_per_round=10,
                local_steps=10,
                batch_size=32,
                lr=L9[4],
                rounds=DRIFT_ROUNDS,
                eval_every=1,
            ),
            drift_methods,
            [
                ("FedNLR mu0=0.5", "FedAvg", -1, "select"),
                ("FedNLR mu0=2.0", "FedAvg", -1, "select"),
                ("FedAvg", None, -1, "change"),
            ],
            "drift_size",
            "drift size (mean |change| of the bounded neurons' activation)",
            lower_is_better=True,
            kind="drift",
            digits=4,
            paper={"FedNLR vs FedAvg": "MNIST, one pair: -0.01..-0.04 vs -0.03..-0.06 (Table 4)"},
        ),
    ]
    return {e.name: e for e in exps}


# ------------------------------------------------------------------ running and summarising
def quick_version(exp: Experiment) -> Experiment:
    """One round, one point per method: checks that the experiment's code runs end to end."""
    base = dict(exp.base, rounds=1, eval_every=1, local_steps=3)
    if "decay_every" in base:
        base.update(decay_every=1, finetune_steps=1)
    methods = exp.methods

    def first_points(pilot):
        return {m: dict(list(points.items())[:1]) for m, points in methods(pilot).items()}

    return dataclasses.replace(exp, base=base, methods=first_points)


def run_experiment(exp: Experiment, args: argparse.Namespace) -> Dict[str, Any]:
    out_dir = Path(args.out)
    run_dir = out_dir / exp.name / "runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    load_before = os.getloadavg()
    pilot_path = out_dir / exp.name / "pilot.json"
    if exp.pilot is None:
        pilot: Dict[str, Any] = {}
    elif pilot_path.exists():
        pilot = json.loads(pilot_path.read_text())
    else:
        pilot = exp.pilot(exp, args)
        pilot_path.write_text(json.dumps(pilot, indent=1, default=float) + "\n")
    methods = exp.methods(pilot)
    points = {key: cfg for grid in methods.values() for key, cfg in grid.items()}
    jobs = []
    for key, over in [] if args.no_run else points.items():
        for seed in args.seeds:
            path = run_dir / f"{key}__s{seed}.json"
            if not path.exists():
                jobs.append((exp.kind, dict(exp.base, **over, seed=seed), pilot, str(path)))
    print(f"[{exp.name}] {len(points)} grid points x {len(args.seeds)} seeds: {len(jobs)} runs to do", flush=True)
    if args.jobs > 1 and len(jobs) > 1:
        # CUDA cannot be used in a forked child of a process that used it (the pilot)
        start_method = "spawn" if args.device == "cuda" else "fork"
        with multiprocessing.get_context(start_method).Pool(args.jobs) as pool:
            for i, (done, secs) in enumerate(pool.imap_unordered(_worker, jobs), 1):
                print(f"[{exp.name}] {i}/{len(jobs)} {Path(done).stem} ({secs:.1f} s)", flush=True)
    else:
        for i, job in enumerate(jobs, 1):
            done, secs = _worker(job)
            print(f"[{exp.name}] {i}/{len(jobs)} {Path(done).stem} ({secs:.1f} s)", flush=True)
    seeds = [s for s in args.seeds if all((run_dir / f"{k}__s{s}.json").exists() for k in points)]
    if not seeds:
        raise SystemExit(f"[{exp.name}] no seed has all its runs in {run_dir}")
    runs = {key: {s: json.loads((run_dir / f"{key}__s{s}.json").read_text()) for s in seeds} for key in points}
    timing = {
        "wall_seconds_this_call": time.perf_counter() - start,
        "runs_done_this_call": len(jobs),
        "run_seconds_total": sum(r["seconds"] for per in runs.values() for r in per.values()),
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "jobs": args.jobs,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }
    summary = summarise(exp, methods, runs, seeds)
    payload = {
        "experiment": exp.name,
        "base": exp.base,
        "pilot": pilot,
        "seeds": seeds,
        "methods": {m: list(g) for m, g in methods.items()},
        "summary": summary,
        "timing": timing,
    }
    (out_dir / f"{exp.name}.json").write_text(json.dumps(payload, indent=1, default=float) + "\n")
    md = markdown(exp, pilot, summary, timing)
    (out_dir / f"{exp.name}.md").write_text(md)
    print(md, flush=True)
    return payload


def _score(value: Any) -> Tuple:
    return tuple(value) if isinstance(value, list) else (value,)


def select(grid: Sequence[str], runs: Dict[str, Dict[int, Dict]], seed: int) -> str:
    """The grid point with the best validation score on this seed (ties: the first in grid order)."""
    best = grid[0]
    for key in grid[1:]:
        if _score(runs[key][seed]["val_score"]) > _score(runs[best][seed]["val_score"]):
            best = key
    return best


def verdict(diffs: Sequence[float], sign: int) -> Dict[str, Any]:
    """The protocol's rule: the paired mean difference against two standard errors."""
    d = np.asarray(diffs, dtype=np.float64)
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else float("nan")
    if not (abs(mean) > 2 * se):  # also when se is nan (one seed): nothing is resolved
        word = "not resolved"
    else:
        word = "reproduced" if mean * sign > 0 else "contradicted"
    return {"mean": mean, "se": se, "verdict": word, "diffs": d.tolist()}


def summarise(
    exp: Experiment, methods: Dict[str, Dict[str, Dict]], runs: Dict[str, Dict[int, Dict]], seeds: Sequence[int]
) -> Dict[str, Any]:
    per_method: Dict[str, Dict[str, Any]] = {}
    for m, grid in methods.items():
        keys = list(grid)
        chosen = {s: select(keys, runs, s) for s in seeds}
        per_method[m] = {
            "chosen": chosen,
            "select": [runs[chosen[s]][s][exp.metric] for s in seeds],
            "sweep_mean": [float(np.mean([runs[k][s][exp.metric] for k in keys])) for s in seeds],
            "extras": {
                x: [runs[chosen[s]][s].get(x) for s in seeds]
                for x in (
                    "test_acc",
                    "clipped_fraction",
                    "new_global_test",
                    "existing_finetuned_test",
                    "reached",
                    "change",
                )
            },
        }
    comps = []
    for method, baseline, sign, how in exp.comparisons:
        # how: "select" / "sweep_mean" (the compared metric), else an extra (e.g. "change");
        # baseline None: against zero
        def values(m, how=how):
            return per_method[m][how] if how in ("select", "sweep_mean") else per_method[m]["extras"][how]

        a = values(method)
        b = [0.0] * len(a) if baseline is None else values(baseline)
        comps.append(
            {
                "method": method,
                "baseline": "0" if baseline is None else baseline,
                "how": how,
                "sign": sign,
                **verdict([x - y for x, y in zip(a, b)], sign),
            }
        )
    return {
        "methods": per_method,
        "comparisons": comps,
        "points": {
            k: {s: {x: v for x, v in r.items() if not x.startswith("curve")} for s, r in per.items()}
            for k, per in runs.items()
        },
    }


def _ms(values: Sequence[float], scale: float, digits: int = 2) -> str:
    a = scale * np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return "-"
    return f"{a.mean():.{digits}f}" if a.size == 1 else f"{a.mean():.{digits}f} ± {a.std(ddof=1):.{digits}f}"


def markdown(exp: Experiment, pilot: Dict[str, Any], summary: Dict[str, Any], timing: Dict[str, Any]) -> str:
    scale = 1.0 if exp.lower_is_better else 100.0  # accuracies in %, rounds as they are
    lines = [
        f"### {exp.name}",
        "",
        f"Compared metric: {exp.metric_label}; mean ± sd over seeds; per seed each "
        "method's grid point is chosen on validation.",
        "",
    ]
    if pilot:
        lines += [
            "Pilot / fixed before the comparison: "
            + ", ".join(
                f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}"
                for k, v in pilot.items()
                if not isinstance(v, dict)
            ),
            "",
        ]
    lines += [
        "| method | selected (per seed) | " + exp.metric_label + " | sweep mean | clipped fraction |",
        "|---|---|---|---|---|",
    ]
    for m, s in summary["methods"].items():
        chosen = ", ".join(dict.fromkeys(s["chosen"].values()))
        clip = (
            _ms(s["extras"]["clipped_fraction"], 1.0)
            if any(v is not None for v in s["extras"]["clipped_fraction"])
            else "-"
        )
        nd = exp.digits
        lines.append(f"| {m} | {chosen} | {_ms(s['select'], scale, nd)} | {_ms(s['sweep_mean'], scale, nd)} | {clip} |")
    lines += ["", "| comparison | how | paired mean difference ± SE | per seed | verdict |", "|---|---|---|---|---|"]
    for c in summary["comparisons"]:
        nd = exp.digits
        per = ", ".join(f"{scale * d:+.{nd}f}" for d in c["diffs"])
        lines.append(
            f"| {c['method']} vs {c['baseline']} | {c['how']} | {scale * c['mean']:+.{nd}f} ± "
            f"{scale * c['se']:.{nd}f} | {per} | {c['verdict']} |"
        )
    lines += [
        "",
        f"Runs: {timing['runs_done_this_call']} in this call, wall {timing['wall_seconds_this_call']:.0f} s "
        f"with {timing['jobs']} process(es); all runs' own time {timing['run_seconds_total']:.0f} s; "
        f"load {timing['load_before'][0]:.1f} → {timing['load_after'][0]:.1f} on {timing['cpus']} CPUs.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    names = list(experiments("digits", None))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=names + ["all"])
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="paired seeds (default 0 1 2 3 4)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel processes (default %(default)s)")
    p.add_argument("--out", default=str(HERE / "protocol"), help="results folder (default experiments/protocol)")
    p.add_argument("--data-dir", default=FMNIST, help="Fashion-MNIST's folder (default %(default)s)")
    p.add_argument(
        "--dataset",
        default="fmnist",
        choices=("fmnist", "digits"),
        help="digits: scikit-learn's built-in digits, for a smoke test without Fashion-MNIST",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where clients train (default cpu)")
    p.add_argument(
        "--client-parallel",
        type=int,
        default=1,
        help="clients trained at once by the client-batched engine (default 1: one after another; FedNAR always 1)",
    )
    p.add_argument(
        "--no-run", action="store_true", help="train nothing: summarise the seeds whose runs are all on disk"
    )
    p.add_argument("--quick", action="store_true", help="1 seed, 1 round, the first grid point of each method")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    if args.client_parallel < 1:
        p.error("--client-parallel must be >= 1")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error("--seeds must be distinct integers >= 0")
    if PILOT_SEED in args.seeds:
        p.error(f"seed {PILOT_SEED} is the pilots' seed: the comparisons must not use it")
    if args.quick:
        args.seeds = args.seeds[:1]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    exps = experiments(args.dataset, args.data_dir, args.device, args.client_parallel)
    for name in list(exps) if args.experiment == "all" else [args.experiment]:
        exp = quick_version(exps[name]) if args.quick else exps[name]
        run_experiment(exp, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
