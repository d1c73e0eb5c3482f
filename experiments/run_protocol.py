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
sys.path.insert(0, str(HERE.parent))  # fedopt_kernels from this checkout
sys.path.insert(0, str(HERE))  # provenance.py beside this script, one module name for it (mypy, imports)

from provenance import UNRECORDED, provenance, source_key, stamp, utc_now  # noqa: E402

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
    # pilot -> method -> point -> overrides; experiments with axes also take the growth (ext)
    methods: Callable[..., Dict[str, Dict[str, Dict[str, Any]]]]
    # (method, baseline or None for zero, paper's sign, "select" | "sweep_mean" | "band" | an extra)
    comparisons: Sequence[Tuple[str, Optional[str], int, str]]
    metric: str  # the compared test metric
    metric_label: str
    lower_is_better: bool = False
    kind: str = "final"  # how a run is measured: "final", "newusers", "curve", "norms"
    pilot: Optional[Callable[[Experiment, argparse.Namespace], Dict[str, Any]]] = None
    paper: Dict[str, str] = dataclasses.field(default_factory=dict)  # comparison label -> the paper's number
    digits: int = 2  # decimals the tables show
    # the edge rule (protocol.md, "Grids that end inside"): the config keys of the tuned ladders that
    # grow by one step wherever a seed's pick (rule "select") or band (rule "band") touches an end;
    # experiments with axes take methods(pilot, ext), ext[(method, axis)] = (steps below, steps above)
    axes: Sequence[str] = ()
    rule: str = "select"
    tuning: Optional[Tuning] = None  # a tuning stage run before the comparison
    # (name, method, baseline, axis): per seed, the method's points at the baseline's selected axis value
    on_top: Sequence[Tuple[str, str, str, str]] = ()
    seeds: Optional[Sequence[int]] = None  # this comparison's paired seeds (default SEEDS)


@dataclasses.dataclass
class Tuning:
    """A tuning stage on one seed that no comparison uses (``PILOT_SEED``): every tuning method's
    grid, grown by the edge rule, and its best validation point. The comparison's grids are built
    from those picks (``pilot["tuned"][method]``)."""

    methods: Callable[[Dict[str, Any], Dict[Tuple[str, str], Tuple[int, int]]], Dict[str, Dict[str, Dict[str, Any]]]]
    axes: Sequence[str] = ("lr",)
    seed: int = 1000
    floors: Sequence[str] = ()  # axes whose ladder never grows below its first value


Grids = Dict[str, Dict[str, Dict[str, Any]]]
Ext = Dict[Tuple[str, str], Tuple[int, int]]
MAX_EXTRA = 4  # the edge rule grows a ladder by at most this many steps on each side
BAND_DROP = 0.05  # rule "band": the step sizes within 5 points of a seed's best accuracy
TUNED_KEYS = ("lr", "weight_decay", "prox_mu", "server_lr")  # the settings a tuning stage reports


def ladder(anchor: float, ratio: float, lo: int, hi: int, below: int = 0, above: int = 0) -> List[float]:
    """The geometric ladder anchor × ratio^k, k = lo..hi, grown by ``below``/``above`` steps; 4 digits."""
    return [float(f"{anchor * ratio**k:.4g}") for k in range(lo - below, hi + above + 1)]


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
    if getattr(sim, "privacy", None) is not None:  # the accountant's epsilon for the run as run
        from fedopt_kernels.sim import dp_round

        out["privacy"] = dp_round.summary(sim, sim.dp_stopped)
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


def _worker(job: Tuple[str, Dict[str, Any], Dict[str, Any], str, Dict[str, Any]]) -> Tuple[str, float]:
    kind, cfg, pilot, path, prov = job
    started = utc_now()
    result = measure(kind, cfg, pilot)
    record = {"config": cfg, **result, "provenance": stamp(prov, started, utc_now())}
    Path(path).write_text(json.dumps(record, default=float) + "\n")
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


# ------------------------------------------------------------------ the second round (protocol.md §7-§10)
HALF = 10**0.5  # half a decade
QUARTER = 10**0.25  # a quarter decade
EIGHTH = 10**0.125  # an eighth of a decade


def _grown(ext: Ext, method: str, axis: str) -> Tuple[int, int]:
    return ext.get((method, axis), (0, 0))


# §7 FedDyn against FedAvg on 10 paired seeds, every pick inside its grid
FEDDYN10_SEEDS = tuple(range(10))
FEDDYN10_ALPHAS = (0.1, HALF, 0, 1)  # 0.1, 0.316: the first round picked α 0.1, its top
FEDDYN10_DYN_LRS = (0.1, QUARTER, -1, 1)  # 0.0562, 0.1, 0.178: around 0.1, the first round's pick
FEDDYN10_AVG_LRS = (0.1, EIGHTH, -1, 4)  # 0.075 ... 0.316: eighth decades around 0.144-0.208


def feddyn10_methods(pilot: Dict[str, Any], ext: Ext) -> Grids:
    alphas = ladder(*FEDDYN10_ALPHAS, *_grown(ext, "FedDyn", "dyn_alpha"))
    dyn_lrs = ladder(*FEDDYN10_DYN_LRS, *_grown(ext, "FedDyn", "lr"))
    avg_lrs = ladder(*FEDDYN10_AVG_LRS, *_grown(ext, "FedAvg", "lr"))
    return {
        "FedDyn": {
            f"feddyn_a{_fmt(a)}_lr{_fmt(lr)}": dict(algorithm="feddyn", dyn_alpha=a, lr=lr)
            for a in alphas
            for lr in dyn_lrs
        },
        "FedAvg": {f"fedavg_lr{_fmt(lr)}": dict(algorithm="fedavg", lr=lr) for lr in avg_lrs},
    }


# §8 FedNLR against FedAvg at the same learning rates (Dirichlet 0.05)
FEDNLR_LADDER = (0.03, QUARTER, 1, 5)
FEDNLR_LR_LADDER = tuple(ladder(*FEDNLR_LADDER))  # 0.05335 ... 0.5335: quarter decades of L9
FEDNLR_MU0 = (1.0, 2.0, -1, 1)  # 0.5, 1, 2 (§2's grid), grown by the edge rule in its own step (x2)


def _mu0_grown(ext: Ext) -> Tuple[int, int]:
    """One μ0 ladder for every FedNLR cell: grown on a side when any cell's pick touches that end."""
    grown = [v for (_, axis), v in ext.items() if axis == "nlr_mu0"]
    return (max((b for b, _ in grown), default=0), max((a for _, a in grown), default=0))


def fednlr_lr_methods(pilot: Dict[str, Any], ext: Ext) -> Grids:
    """Design A: both methods over the same lrs, FedNLR's μ0 tuned on top (3x FedAvg's points, more
    once the edge rule grows μ0's ladder).
    Design B (FedNLR at FedAvg's selected lr, μ0 tuned: ``Experiment.on_top``) and the per-lr
    comparisons read the same runs."""
    lrs = ladder(*FEDNLR_LADDER, *_grown(ext, "FedNLR", "lr"))
    avg = ladder(*FEDNLR_LADDER, *_grown(ext, "FedAvg", "lr"))
    # both ladders grow together: the two methods keep the same lr points
    lrs = sorted(set(lrs) | set(avg))
    mu0s = ladder(*FEDNLR_MU0, *_mu0_grown(ext))
    nlr = {lr: {f"fednlr_mu{m}_lr{_fmt(lr)}": dict(algorithm="fednlr", nlr_mu0=m, lr=lr) for m in mu0s} for lr in lrs}
    fedavg = {lr: {f"fedavg_lr{_fmt(lr)}": dict(algorithm="fedavg", lr=lr)} for lr in lrs}
    out: Grids = {
        "FedNLR": {k: v for lr in lrs for k, v in nlr[lr].items()},
        "FedAvg": {k: v for lr in lrs for k, v in fedavg[lr].items()},
    }
    for lr in FEDNLR_LR_LADDER:  # the paper's Fig. 2: at each lr, FedNLR (μ0 tuned) against FedAvg
        out[f"FedNLR lr={_fmt(lr)}"], out[f"FedAvg lr={_fmt(lr)}"] = nlr[lr], fedavg[lr]
    return out


# §9 PAdaMFed's step-size band, each sweep centred on the method's own optimum
PADAM_BAND_START = {"PAdaMFed": 10.0, "FedAvg": 0.1, "SCAFFOLD": 0.01}  # each: 3 half-decade points from here


def _padam_point(method: str, x: float, pilot: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    if method == "PAdaMFed":  # x = c, the factor on the theory's η and γ
        return f"padamfed_c{_fmt(x)}", dict(algorithm="padamfed", lr=pilot["eta"] * x, server_lr=pilot["gamma"] * x)
    return f"{method.lower()}_lr{_fmt(x)}", dict(algorithm=method.lower(), lr=x)


def padamfed_band_tuning(pilot: Dict[str, Any], ext: Ext) -> Grids:
    """Each method's optimum on the tuning seed: a half-decade ladder grown until its pick is inside."""
    return {
        m: dict(_padam_point(m, x, pilot) for x in ladder(start, HALF, 0, 2, *_grown(ext, m, "lr")))
        for m, start in PADAM_BAND_START.items()
    }


def padamfed_band_methods(pilot: Dict[str, Any], ext: Ext) -> Grids:
    """Seven half-decade points (±1.5 decades) around each method's tuned optimum, grown by the
    band rule; plus PAdaMFed at its theory step sizes (c = 1) for claim (a)."""
    out: Grids = {}
    for m in PADAM_BAND_START:
        tuned = pilot["tuned"][m]["lr"]
        centre = tuned / pilot["eta"] if m == "PAdaMFed" else tuned
        below, above = _grown(ext, m, "lr")
        out[m] = dict(_padam_point(m, x, pilot) for x in lattice(centre, 0.5, 3 + below, 3 + above))
    out["PAdaMFed (theory)"] = dict([_padam_point("PAdaMFed", 1.0, pilot)])
    return out


# §10 FedNAR against each backbone with its weight decay tuned, without clipping
FEDNAR_WD_GRID = (0.0, 1e-3, 1e-2, 1e-1)


def _fednar_variants(max_norm: float) -> List[Tuple[str, str, Dict[str, Any]]]:
    """(cell, algorithm, fixed settings): each backbone without clipping, and with FedNAR's co-clipping."""
    out: List[Tuple[str, str, Dict[str, Any]]] = []
    for label, base_algo, nar_algo in FEDNAR_BACKBONES:
        out.append((label, base_algo, {}))
        out.append((f"FedNAR-{label}", nar_algo, {"clip_norm": max_norm}))
    return out


def fednar_wd_tuning(pilot: Dict[str, Any], ext: Ext) -> Grids:
    """Per variant: weight decay over FEDNAR_WD_GRID × lr over L3 (× FedProx's μ over 0.01, 0.1, 1);
    the lr and μ ladders grow until the tuning seed's pick is inside."""
    out: Grids = {}
    for cell, algo, fixed in _fednar_variants(pilot["max_norm"]):
        lrs = ladder(0.03, HALF, 0, 2, *_grown(ext, cell, "lr"))  # L3: 0.03, 0.0949, 0.3
        mus = ladder(0.01, 10.0, 0, 2, *_grown(ext, cell, "prox_mu")) if "fedprox" in algo else [None]
        out[cell] = {
            f"{algo}_wd{wd:g}_lr{_fmt(lr)}" + ("" if mu is None else f"_mu{_fmt(mu)}"): dict(
                algorithm=algo, weight_decay=wd, lr=lr, **fixed, **({} if mu is None else {"prox_mu": mu})
            )
            for wd in FEDNAR_WD_GRID
            for lr in lrs
            for mu in mus
        }
    return out


def _key(cfg: Dict[str, Any]) -> str:
    name = f"{cfg['algorithm']}_wd{cfg['weight_decay']:g}_lr{_fmt(cfg['lr'])}"
    return name + (f"_mu{_fmt(cfg['prox_mu'])}" if "prox_mu" in cfg else "")


def fednar_wd_methods(pilot: Dict[str, Any]) -> Grids:
    """Each variant at its tuning-seed pick (weight decay, lr, μ) on the paired seeds."""
    return {
        cell: {_key(pilot["tuned"][cell]): pilot["tuned"][cell]} for cell, _, _ in _fednar_variants(pilot["max_norm"])
    }


def experiments(
    dataset: str, data_dir: Optional[str], device: str = "cpu", client_batched: int = 1
) -> Dict[str, Experiment]:
    """The six comparisons; ``device``/``client_batched`` only change where and how clients train."""
    data = dict(
        dataset=dataset,
        data_dir=data_dir if dataset != "digits" else None,
        model="mlp",
        backend="reference",
        device=device,
        client_batched=client_batched,
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
                client_batched=1,
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
        # the second round (protocol.md §7-§10): every pick inside its grid, provenance in every run
        Experiment(
            "feddyn10",
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
            feddyn10_methods,
            [("FedDyn", "FedAvg", -1, "select")],
            "rounds_test",
            "rounds to the target test accuracy",
            lower_is_better=True,
            kind="curve",
            pilot=feddyn_pilot,
            paper={"FedDyn vs FedAvg": "fewer rounds to target (Acar et al. 2021)"},
            axes=("lr", "dyn_alpha"),
            seeds=FEDDYN10_SEEDS,
        ),
        Experiment(
            "fednlr-lr",
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
            fednlr_lr_methods,
            [("FedNLR", "FedAvg", +1, "select"), ("FedNLR on FedAvg's lr", "FedAvg", +1, "select")]
            + [(f"FedNLR lr={_fmt(lr)}", f"FedAvg lr={_fmt(lr)}", +1, "select") for lr in FEDNLR_LR_LADDER],
            "test_acc",
            "pooled test accuracy (%)",
            axes=("lr", "nlr_mu0"),
            on_top=[("FedNLR on FedAvg's lr", "FedNLR", "FedAvg", "lr")],
            paper={"FedNLR vs FedAvg": "CIFAR-10 Dir(0.1): 63.40 vs 63.30 (Table 3), every method at lr 0.01"},
        ),
        Experiment(
            "padamfed-band",
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
            padamfed_band_methods,
            [
                ("PAdaMFed", "FedAvg", +1, "band"),
                ("PAdaMFed", "SCAFFOLD", +1, "band"),
                ("PAdaMFed (theory)", "FedAvg", +1, "select"),
                ("PAdaMFed (theory)", "SCAFFOLD", +1, "select"),
                ("PAdaMFed", "FedAvg", +1, "select"),
                ("PAdaMFed", "SCAFFOLD", +1, "select"),
            ],
            "test_acc",
            "pooled test accuracy (%)",
            pilot=padamfed_pilot,
            axes=("lr",),
            rule="band",
            tuning=Tuning(padamfed_band_tuning),
            paper={"PAdaMFed vs FedAvg": "figures only (EMNIST): a much wider step-size range"},
        ),
        Experiment(
            "fednar-wd",
            dict(
                data,
                client_batched=1,
                dirichlet_alpha=0.3,
                clients=100,
                clients_per_round=10,
                local_steps=20,
                batch_size=32,
                rounds=50,
                eval_every=50,
                round_decay=0.998,
            ),
            fednar_wd_methods,
            [(f"FedNAR-{b}", b, +1, "select") for b, _, _ in FEDNAR_BACKBONES],
            "test_acc",
            "pooled test accuracy (%)",
            kind="norms",
            pilot=fednar_pilot,
            # μ → 0 is FedAvg, tuned in its own cell: FedProx's μ ladder does not grow below 0.01
            tuning=Tuning(fednar_wd_tuning, axes=("lr", "prox_mu"), floors=("prox_mu",)),
            paper={
                f"FedNAR-{b} vs {b}": p
                for (b, _, _), p in zip(
                    FEDNAR_BACKBONES, ("CIFAR-10 Dir(0.3): 87.64 vs 85.19", "87.45 vs 85.02", "89.17 vs 86.89")
                )
            },
        ),
        # clients take their local steps one at a time here: the drift hooks the sequential step
        Experiment(
            "fednlr-drift",
            dict(
                data,
                client_batched=1,
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
def lattice(centre: float, step: float, below: int, above: int) -> List[float]:
    """Points ``step`` decades apart on the lattice 10^(k * step) nearest ``centre``, ``below`` of them
    under it and ``above`` over it, 4 significant digits."""
    k0 = round(math.log10(centre) / step)
    return [float(f"{10 ** ((k0 + j) * step):.4g}") for j in range(-below, above + 1)]


def quick_version(exp: Experiment) -> Experiment:
    """One round, one point per method: checks that the experiment's code runs end to end."""
    base = dict(exp.base, rounds=1, eval_every=1, local_steps=3)
    if "decay_every" in base:
        base.update(decay_every=1, finetune_steps=1)

    def first(fn):
        def first_points(pilot, *ext):
            return {m: dict(list(points.items())[:1]) for m, points in fn(pilot, *ext).items()}

        return first_points

    tuning = exp.tuning and dataclasses.replace(exp.tuning, methods=first(exp.tuning.methods))
    return dataclasses.replace(exp, base=base, methods=first(exp.methods), tuning=tuning)


def band(xs: Sequence[float], ys: Sequence[float], drop: float = BAND_DROP) -> Tuple[float, bool, bool]:
    """Rule "band": the width (in decades) of the step sizes around a seed's best accuracy whose
    accuracy stays within ``drop`` of it, its ends interpolated linearly in log10(step size)
    between sweep points; and whether it reaches the sweep's low / high end (then it is censored).

    ``xs``: log10 of the sweep's step sizes, ascending; ``ys``: the test accuracies."""
    y = [v if v == v else -math.inf for v in ys]  # a NaN accuracy counts as the worst
    best = max(range(len(y)), key=lambda i: (y[i], -i))
    floor = y[best] - drop
    lo = best
    while lo > 0 and y[lo - 1] >= floor:
        lo -= 1
    hi = best
    while hi < len(y) - 1 and y[hi + 1] >= floor:
        hi += 1

    def cross(inside: int, outside: int) -> float:
        t = (y[inside] - floor) / (y[inside] - y[outside]) if math.isfinite(y[outside]) else 0.0
        return xs[inside] + t * (xs[outside] - xs[inside])

    left = xs[0] if lo == 0 else cross(lo, lo - 1)
    right = xs[-1] if hi == len(y) - 1 else cross(hi, hi + 1)
    return right - left, lo == 0, hi == len(y) - 1


def band_points(grid: Dict[str, Dict[str, Any]], axis: str) -> List[str]:
    """A one-axis sweep's points in ascending order of the axis."""
    return sorted(grid, key=lambda k: grid[k][axis])


def edges(
    exp: Experiment,
    methods: Grids,
    runs: Dict[str, Dict[int, Dict]],
    seeds: Sequence[int],
    axes: Sequence[str],
    rule: str,
) -> Ext:
    """The edge rule: for every method and tuned axis, (1, ·) where some seed's pick (rule "select")
    or band (rule "band") touches the low end of the axis's values, (·, 1) the high end."""
    out: Ext = {}
    for m, grid in methods.items():
        for axis in axes:
            values = sorted({cfg[axis] for cfg in grid.values() if axis in cfg})
            if len(values) < 2:
                continue
            low = high = False
            for s in seeds:
                v = grid[select(list(grid), runs, s)][axis]
                low_s, high_s = v == values[0], v == values[-1]
                if rule == "band":  # the band must end inside the sweep too
                    keys = band_points(grid, axis)
                    _, cut_low, cut_high = band(
                        [math.log10(grid[k][axis]) for k in keys], [runs[k][s][exp.metric] for k in keys]
                    )
                    low_s, high_s = low_s or cut_low, high_s or cut_high
                low, high = low or low_s, high or high_s
            if low or high:
                out[(m, axis)] = (int(low), int(high))
    return out


def _check_sources(exp_name: str, methods: Grids, run_dir: Path, todo: set, key: str, mix: bool) -> None:
    """Refuse to add a run to a cell (one method's grid over the seeds) whose runs on disk came
    from another commit (or a dirty tree, or before run files recorded it), unless ``mix``."""
    if mix:
        return
    for m, grid in methods.items():
        if not any(path.name.split("__s")[0] in grid for path in map(Path, todo)):
            continue
        found = set()
        for k in grid:
            for path in run_dir.glob(f"{k}__s*.json"):
                if str(path) not in todo:
                    found.add(source_key(json.loads(path.read_text())))
        other = sorted(found - {key})
        if other:
            raise SystemExit(
                f"[{exp_name}] the cell {m!r} has runs from {', '.join(other)} and this command "
                f"is at {key}: run the cell from one commit (move its run files away) or pass "
                f"--mix-commits to mix them knowingly"
            )


def run_grid(
    exp: Experiment,
    methods_fn: Callable,
    axes: Sequence[str],
    rule: str,
    pilot: Dict[str, Any],
    seeds: Sequence[int],
    run_dir: Path,
    args: argparse.Namespace,
    prov: Dict[str, Any],
    label: str,
    floors: Sequence[str] = (),
) -> Tuple[Grids, Dict, List[int], Ext]:
    """Run every point of every method on every seed (skipping runs on disk), growing the grids by
    the edge rule until no pick touches an end (or a ladder has grown MAX_EXTRA steps on a side).
    Returns the final grids, their runs, the seeds with every run on disk, and the growth."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ext: Ext = {}
    while True:
        methods = methods_fn(pilot, ext) if axes else methods_fn(pilot)
        points = {key: cfg for grid in methods.values() for key, cfg in grid.items()}
        missing = [(key, s) for key in points for s in seeds if not (run_dir / f"{key}__s{s}.json").exists()]
        if args.no_run and missing and ext:
            break  # summarise the grids as far as their runs exist
        jobs = (
            []
            if args.no_run
            else [
                (exp.kind, dict(exp.base, **points[k], seed=s), pilot, str(run_dir / f"{k}__s{s}.json"), prov)
                for k, s in missing
            ]
        )
        _check_sources(
            exp.name, methods, run_dir, {j[3] for j in jobs}, source_key({"provenance": prov}), args.mix_commits
        )
        print(f"[{label}] {len(points)} grid points x {len(seeds)} seeds: {len(jobs)} runs to do", flush=True)
        _run_jobs(jobs, args, label)
        args.runs_done = getattr(args, "runs_done", 0) + len(jobs)
        done = [s for s in seeds if all((run_dir / f"{k}__s{s}.json").exists() for k in points)]
        if not done:
            raise SystemExit(f"[{label}] no seed has all its runs in {run_dir}")
        runs = {k: {s: json.loads((run_dir / f"{k}__s{s}.json").read_text()) for s in done} for k in points}
        grow = edges(exp, methods, runs, done, axes, rule) if axes else {}
        grow = {key: (0 if key[1] in floors else lo, hi) for key, (lo, hi) in grow.items()}
        grow = {key: v for key, v in grow.items() if v != (0, 0)}
        new = dict(ext)
        for (m, axis), (lo, hi) in grow.items():
            below, above = new.get((m, axis), (0, 0))
            new[(m, axis)] = (min(below + lo, MAX_EXTRA), min(above + hi, MAX_EXTRA))
        if new == ext:
            return methods, runs, done, ext
        print(
            f"[{label}] the edge rule grows "
            + ", ".join(f"{m} {a} {b}/{c}" for (m, a), (b, c) in new.items() if new[(m, a)] != ext.get((m, a))),
            flush=True,
        )
        ext = new
    methods = methods_fn(pilot, ext) if axes else methods_fn(pilot)  # the last grids with all runs
    points = {key: cfg for grid in methods.values() for key, cfg in grid.items()}
    runs = {k: {s: json.loads((run_dir / f"{k}__s{s}.json").read_text()) for s in done} for k in points}
    return methods, runs, done, ext


def _run_jobs(jobs: List[Tuple], args: argparse.Namespace, label: str) -> None:
    if args.jobs > 1 and len(jobs) > 1:
        # CUDA cannot be used in a forked child of a process that used it (the pilot)
        start_method = "spawn" if args.device == "cuda" else "fork"
        with multiprocessing.get_context(start_method).Pool(args.jobs) as pool:
            for i, (path, secs) in enumerate(pool.imap_unordered(_worker, jobs), 1):
                print(f"[{label}] {i}/{len(jobs)} {Path(path).stem} ({secs:.1f} s)", flush=True)
    else:
        for i, job in enumerate(jobs, 1):
            path, secs = _worker(job)
            print(f"[{label}] {i}/{len(jobs)} {Path(path).stem} ({secs:.1f} s)", flush=True)


def cell_sources(grid: Dict[str, Dict], runs: Dict[str, Dict[int, Dict]]) -> Dict[str, Any]:
    """Where one cell's runs came from: commits, devices, the first start and last end (UTC)."""
    recs = [r for k in grid for r in runs[k].values()]
    provs = [r.get("provenance") or {} for r in recs]
    starts = sorted(p["started_utc"] for p in provs if p.get("started_utc"))
    ends = sorted(p["ended_utc"] for p in provs if p.get("ended_utc"))
    devices = {p.get("device_name") or r["config"].get("device", "?") for p, r in zip(provs, recs)}
    return {
        "sources": sorted({source_key(r) for r in recs}),
        "devices": sorted(devices),
        "first_start_utc": starts[0] if starts else None,
        "last_end_utc": ends[-1] if ends else None,
        "runs": len(recs),
    }


def run_experiment(exp: Experiment, args: argparse.Namespace) -> Dict[str, Any]:
    out_dir = Path(args.out)
    (out_dir / exp.name).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    args.runs_done = 0
    load_before = os.getloadavg()
    script = getattr(args, "script", "experiments/run_protocol.py")  # the command that declares the experiment
    prov = provenance(args.device, args.argv, exclude=[out_dir], script=script)
    seeds = args.seeds if args.seeds is not None else list(exp.seeds or SEEDS)
    if args.quick:
        seeds = seeds[:1]
    pilot_path = out_dir / exp.name / "pilot.json"
    if exp.pilot is None:
        pilot: Dict[str, Any] = {}
    elif pilot_path.exists():
        pilot = json.loads(pilot_path.read_text())
    else:
        started = utc_now()
        pilot = exp.pilot(exp, args)
        pilot["provenance"] = stamp(prov, started, utc_now())
        pilot_path.write_text(json.dumps(pilot, indent=1, default=float) + "\n")
    tuning_summary = None
    if exp.tuning is not None:
        t_methods, t_runs, _, t_ext = run_grid(
            exp,
            exp.tuning.methods,
            exp.tuning.axes,
            "select",
            pilot,
            [exp.tuning.seed],
            out_dir / exp.name / "tuning",
            args,
            prov,
            exp.name + " tuning",
            exp.tuning.floors,
        )
        picks = {m: select(list(g), t_runs, exp.tuning.seed) for m, g in t_methods.items()}
        pilot = dict(pilot, tuned={m: t_methods[m][k] for m, k in picks.items()})
        tuning_summary = {
            "seed": exp.tuning.seed,
            "picks": picks,
            "grown": {f"{m} {a}": v for (m, a), v in t_ext.items()},
            "grids": {m: list(g) for m, g in t_methods.items()},
            "val": {k: t_runs[k][exp.tuning.seed]["val_score"] for k in t_runs},
            "sources": {m: cell_sources(g, t_runs) for m, g in t_methods.items()},
        }
    methods, runs, seeds, ext = run_grid(
        exp, exp.methods, exp.axes, exp.rule, pilot, seeds, out_dir / exp.name / "runs", args, prov, exp.name
    )
    timing = {
        "wall_seconds_this_call": time.perf_counter() - start,
        "runs_done_this_call": args.runs_done,
        "run_seconds_total": sum(r["seconds"] for per in runs.values() for r in per.values()),
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "jobs": args.jobs,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "command": prov["command"],
        "commit": prov["commit"],
        "dirty": prov["dirty"],
        "ended_utc": utc_now(),
    }
    summary = summarise(exp, methods, runs, seeds)
    summary["grown"] = {f"{m} {a}": v for (m, a), v in ext.items()}
    summary["sources"] = {m: cell_sources(g, runs) for m, g in methods.items()}
    payload = {
        "experiment": exp.name,
        "base": exp.base,
        "pilot": pilot,
        "seeds": seeds,
        "methods": {m: list(g) for m, g in methods.items()},
        "tuning": tuning_summary,
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
    """The protocol's rule: the paired mean difference against two standard errors. Also the paired
    t statistic and its two-sided p (Student's t, n - 1 degrees of freedom), which the rule does not read."""
    from scipy.stats import t as student

    d = np.asarray(diffs, dtype=np.float64)
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else float("nan")
    if not (abs(mean) > 2 * se):  # also when se is nan (one seed): nothing is resolved
        word = "not resolved"
    else:
        word = "reproduced" if mean * sign > 0 else "contradicted"
    if d.size > 1 and se > 0:
        tstat = mean / se
        p = float(2 * student.sf(abs(tstat), d.size - 1))
    else:
        tstat, p = float("nan"), float("nan")
    return {"mean": mean, "se": se, "verdict": word, "diffs": d.tolist(), "t": tstat, "p_two_sided": p}


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
            "band": _bands(exp, grid, runs, seeds),
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
    for name, method, baseline, axis in exp.on_top:
        grid, base_grid = methods[method], methods[baseline]
        chosen = {}
        for s in seeds:
            at = base_grid[per_method[baseline]["chosen"][s]][axis]
            chosen[s] = select([k for k in grid if grid[k][axis] == at], runs, s)
        per_method[name] = {
            "chosen": chosen,
            "select": [runs[chosen[s]][s][exp.metric] for s in seeds],
            "sweep_mean": [float("nan")] * len(seeds),
            "band": None,
            "extras": {x: [runs[chosen[s]][s].get(x) for s in seeds] for x in per_method[method]["extras"]},
        }
    comps = []
    for method, base, sign, how in exp.comparisons:
        # how: "select" / "sweep_mean" (the compared metric), else an extra (e.g. "change");
        # baseline None: against zero

        def values(m, how=how):
            return per_method[m][how] if how in ("select", "sweep_mean", "band") else per_method[m]["extras"][how]

        a = values(method)
        b = [0.0] * len(a) if base is None else values(base)
        comps.append(
            {
                "method": method,
                "baseline": "0" if base is None else base,
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


def _bands(
    exp: Experiment, grid: Dict[str, Dict], runs: Dict[str, Dict[int, Dict]], seeds: Sequence[int]
) -> Optional[List[float]]:
    """Rule "band": per seed, the width in decades of the method's band (None for other rules)."""
    if exp.rule != "band":
        return None
    if len(grid) < 2:  # one point (a smoke run): no band
        return [float("nan")] * len(seeds)
    keys = band_points(grid, exp.axes[0])
    xs = [math.log10(grid[k][exp.axes[0]]) for k in keys]
    return [band(xs, [runs[k][s][exp.metric] for k in keys])[0] for s in seeds]


def _ms(values: Sequence[float], scale: float, digits: int = 2) -> str:
    a = scale * np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return "-"
    return f"{a.mean():.{digits}f}" if a.size == 1 else f"{a.mean():.{digits}f} ± {a.std(ddof=1):.{digits}f}"


def _axis_value(cfg: Dict[str, Any], axes: Sequence[str]) -> str:
    return ", ".join(f"{a} {cfg[a]:.4g}" for a in axes if a in cfg)


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
    if pilot.get("tuned"):
        lines += [
            "Tuned on seed "
            + str(PILOT_SEED)
            + ": "
            + "; ".join(
                f"{m}: {', '.join(f'{k} {v:.4g}' for k, v in cfg.items() if k in TUNED_KEYS)}"
                for m, cfg in pilot["tuned"].items()
            ),
            "",
        ]
    band_rule = exp.rule == "band"
    lines += [
        "| method | selected (per seed) | "
        + exp.metric_label
        + " | sweep mean | "
        + ("band width (decades)" if band_rule else "clipped fraction")
        + " |",
        "|---|---|---|---|---|",
    ]
    for m, s in summary["methods"].items():
        chosen = ", ".join(dict.fromkeys(s["chosen"].values()))
        if band_rule:
            last = _ms(s["band"], 1.0) if s["band"] else "-"
        else:
            last = (
                _ms(s["extras"]["clipped_fraction"], 1.0)
                if any(v is not None for v in s["extras"]["clipped_fraction"])
                else "-"
            )
        nd = exp.digits
        lines.append(f"| {m} | {chosen} | {_ms(s['select'], scale, nd)} | {_ms(s['sweep_mean'], scale, nd)} | {last} |")
    lines += [
        "",
        "| comparison | how | paired mean difference ± SE | per seed | two-sided p | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for c in summary["comparisons"]:
        sc, nd = (1.0, 2) if c["how"] == "band" else (scale, exp.digits)
        per = ", ".join(f"{sc * d:+.{nd}f}" for d in c["diffs"])
        p = "-" if c["p_two_sided"] != c["p_two_sided"] else f"{c['p_two_sided']:.3g}"
        lines.append(
            f"| {c['method']} vs {c['baseline']} | {c['how']} | {sc * c['mean']:+.{nd}f} ± "
            f"{sc * c['se']:.{nd}f} | {per} | {p} | {c['verdict']} |"
        )
    if summary.get("grown"):
        lines += [
            "",
            "Grown by the edge rule (steps below / above): "
            + ", ".join(f"{k} {b}/{a}" for k, (b, a) in summary["grown"].items())
            + ".",
        ]
    if summary.get("sources"):
        lines += ["", "| cell | runs | commit(s) | device | first start → last end (UTC) |", "|---|---|---|---|---|"]
        for m, src in summary["sources"].items():
            commits = ", ".join(k if k == UNRECORDED else k[:12] for k in src["sources"])
            lines.append(
                f"| {m} | {src['runs']} | {commits} | {', '.join(src['devices'])} | "
                f"{src['first_start_utc'] or '-'} → {src['last_end_utc'] or '-'} |"
            )
    lines += [
        "",
        f"Runs: {timing['runs_done_this_call']} in this call, wall {timing['wall_seconds_this_call']:.0f} s "
        f"with {timing['jobs']} process(es); all runs' own time {timing['run_seconds_total']:.0f} s; "
        f"load {timing['load_before'][0]:.1f} → {timing['load_after'][0]:.1f} on {timing['cpus']} CPUs.",
        f"Command: `{timing.get('command', '?')}`.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    names = list(experiments("digits", None))
    from fedopt_kernels.sim.cli.renamed import RenamedStore

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiment", choices=names + ["all"])
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="paired seeds (default: the experiment's, 0 1 2 3 4 unless its protocol says otherwise)",
    )
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
        "--client-batched",
        "--client-parallel",  # its earlier name, deprecated
        action=RenamedStore,
        type=int,
        default=1,
        help="clients trained at once by the client-batched engine (default 1: one after another; FedNAR always 1; "
        "--client-parallel: its earlier name, deprecated)",
    )
    p.add_argument(
        "--no-run", action="store_true", help="train nothing: summarise the seeds whose runs are all on disk"
    )
    p.add_argument("--quick", action="store_true", help="1 seed, 1 round, the first grid point of each method")
    p.add_argument(
        "--mix-commits",
        action="store_true",
        help="add runs to a cell whose runs on disk came from another commit (refused by default)",
    )
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    if args.client_batched < 1:
        p.error("--client-batched must be >= 1")
    if args.seeds is not None:
        if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
            p.error("--seeds must be distinct integers >= 0")
        if PILOT_SEED in args.seeds:
            p.error(f"seed {PILOT_SEED} is the pilots' seed: the comparisons must not use it")
        if args.quick:
            args.seeds = args.seeds[:1]
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    exps = experiments(args.dataset, args.data_dir, args.device, args.client_batched)
    for name in list(exps) if args.experiment == "all" else [args.experiment]:
        exp = quick_version(exps[name]) if args.quick else exps[name]
        run_experiment(exp, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
