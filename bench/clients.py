"""``python -m bench clients``: client-steps per second of one FL round on the models the papers train,
one client after another vs all at once, against the device's measured FLOP/s.

Models (``--model``; the papers' input shapes and batch sizes, stated in the table):

* ``small-cnn``: the simulator's small CNN on 8x8 single-channel digits (3,818 parameters), batch 10;
* ``fedavg-cnn``: the CNN of McMahan et al. (AISTATS 2017) on 28x28 MNIST-like images, batch 10
  (the paper: E = 5 epochs of 600 samples, 300 local steps);
* ``resnet18-gn``: ResNet-18 with GroupNorm on 32x32 CIFAR-10 images, batch 50, 20 local steps
  (FedNAR's setting, NeurIPS 2023);
* ``char-lstm``: LEAF's character LSTM on Shakespeare (80-character windows, 80 symbols), batch 10
  (LEAF: one local epoch).

A round: C clients, each from the same global model, K local steps (``--steps``; each model's
default is stated), FedNAR's update (lr 0.05, weight decay 5e-4, max_norm 10). Throughput = C * K /
(wall time of the round). The modes of one C are timed interleaved (round 1 of every mode, then
round 2 of every mode, ...) after one untimed round each; a mode's figure is its best round:

* ``sequential``: per client, load the global model, ``start_round``, K x (forward, backward,
  ``FedNAR.step``), backend auto — what FL libraries do. On a CPU it runs at every C up to
  ``--seq-max-clients`` (200), interleaved with that C's modes, and each C compares with its own
  (other processes' load moves, and a short round is likelier to find a quiet moment than a long
  one); on a GPU its rate does not depend on C, and it runs at the smallest C only;
* ``batched-vmap``: ``torch.func.vmap`` gradients (``sim.parallel.loss.ClientLoss``) + ``BatchedFedNAR``:
  the client-parallel step before the stacked engine;
* ``batched-plain-torch``: the stacked engine's gradients + FedNAR in plain torch on stacked tensors;
* ``batched-fused-default``: the stacked engine (``sim.parallel.stacked``) with its fixed default
  formulations + ``BatchedFedNAR``: what the search is compared against;
* ``batched-fused``: the same with the formulations chosen by measurement on this device
  (``sim.parallel.choose``, ``--formulations``): the simulator's ``--client-parallel`` step;
* ``batched-fused-graph`` (CUDA): that step replayed from a CUDA graph (``--cuda-graph``);
* ``batched-fused-chunked``: the C clients in equal chunks through one trainer, the chunk size chosen
  by measurement among those that fit in memory (``--client-parallel auto``), or ``--chunk``; not
  run when the chosen size is C itself.

Per model and C the report states each layer's formulation and why (the candidates' step times).
Models are run a size at a time: every model's smallest C first, the largest last, so that a run cut
at a deadline still has a row for every model.

Per row: model FLOPs per client-step (forward + backward, counted with ``torch.utils.flop_counter``
on one client's step, the LSTM written out in matmuls), the achieved model FLOP/s and its fraction
of the device's FLOP/s (``peak.py``: the faster of a dense matmul and a dense convolution of the
same dtype, timed at the start and the end of the same run: the larger figure is used), and peak
memory per client (CUDA: ``max_memory_allocated`` over the untimed round, less what was allocated
before the mode was built, over C; CPU: the same from malloc's in-use bytes, read after every
operator; sequential: the whole, as it holds one client at a time).

``--precision`` (fp32, tf32, bf16; ``fedopt_kernels.sim.parallel.precision``) is what every mode's
forward and backward passes compute in, and what the device's FLOP/s are measured in; parameters,
gradients and every update stay float32.

Parts, per step at each C (median of repeated calls): the gradients alone (stacked engine, vmap)
and the update alone (plain torch vs ``BatchedFedNAR``); with ``--layers``, every stacked layer's
forward + backward under each of its candidate formulations (``StackedLayer.candidates``), at the largest C.

Results: ``clients-<device>-<date>.{json,md,png}`` in ``--out-dir`` (default ``bench_runs/``,
git-ignored; ``--out-dir bench/results`` for the committed tables), listed in LATEST.md there.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from fedopt_kernels import FedNAR
from fedopt_kernels.batched import BatchedFedNAR
from fedopt_kernels.core import registry as _registry
from fedopt_kernels.sim.models.build import build_model
from fedopt_kernels.sim.parallel.choose import MODES as FORMULATION_MODES
from fedopt_kernels.sim.parallel.choose import Budget as SearchBudget
from fedopt_kernels.sim.parallel.choose import Chooser
from fedopt_kernels.sim.parallel.host_memory import keep_freed_memory
from fedopt_kernels.sim.parallel.loss import ClientLoss
from fedopt_kernels.sim.parallel.precision import (
    PRECISIONS,
    autocast_scope,
    check_supported,
    precision_scope,
    summary,
)
from fedopt_kernels.sim.parallel.size import activation_bytes, free_bytes
from fedopt_kernels.sim.parallel.stacked import StackedLoss
from fedopt_kernels.sim.parallel.trainer import BatchedTrainer
from fedopt_kernels.sim.parallel_round import _pad_clients

from .contention import OtherLoad
from .machine import ROOT, loadavg, run_meta
from .peak import device_peak
from .timing import Budget, median, time_calls

HP = dict(lr=0.05, weight_decay=5e-4, max_norm=10.0)
SEQ, VMAP, PLAIN, DEFAULTS, FUSED, GRAPH = (
    "sequential",
    "batched-vmap",
    "batched-plain-torch",
    "batched-fused-default",
    "batched-fused",
    "batched-fused-graph",
)
CHUNKED = "batched-fused-chunked"
MODES = (SEQ, VMAP, PLAIN, DEFAULTS, FUSED, GRAPH, CHUNKED)
BATCHED = (DEFAULTS, FUSED, GRAPH, CHUNKED)  # the simulator's client-parallel step in its forms
PART_BUDGET = Budget(warmup=2, min_reps=5, max_reps=200, min_time_s=0.5)


@dataclass(frozen=True)
class Setting:
    """A model in a paper's setting: what the table states about it."""

    model: str  # build_model name
    shape: Tuple[int, ...]
    classes: int
    batch: int
    steps: int  # the bench's default K
    paper: str  # where the setting comes from, with the paper's local steps
    clients: Dict[str, List[int]] = field(default_factory=dict)  # default C per device type
    kwargs: Dict[str, Any] = field(default_factory=dict)


SETTINGS: Dict[str, Setting] = {
    "small-cnn": Setting(
        "cnn",
        (1, 8, 8),
        10,
        10,
        10,
        "the simulator's toy (8x8 digits), K=10",
        {"cpu": [10, 50, 200], "cuda": [10, 50, 200, 1000]},
    ),
    "fedavg-cnn": Setting(
        "fedavg-cnn",
        (1, 28, 28),
        10,
        10,
        10,
        "McMahan et al. 2017, MNIST CNN: B=10, E=5 (300 local steps); timed K=10",
        {"cpu": [5, 20], "cuda": [10, 100, 200]},
    ),
    "char-lstm": Setting(
        "char-lstm",
        (80,),
        80,
        10,
        10,
        "LEAF Shakespeare (Caldas et al. 2018): B=10, 1 local epoch; timed K=10",
        {"cpu": [5, 20], "cuda": [10, 200]},
    ),
    "resnet18-gn": Setting(
        "resnet18-gn",
        (3, 32, 32),
        10,
        50,
        20,
        "FedNAR (Li et al. 2023), CIFAR-10: B=50, 20 local steps",
        {"cpu": [2, 4], "cuda": [4, 16, 32]},
    ),
}
CPU_STEPS = {"resnet18-gn": 2}  # a CPU round of 20 ResNet steps takes minutes per client

# the project's targets (benchmark goals, not tests): (text, model, value function, threshold)
GOALS = {
    "cpu": [
        (
            "small-cnn: batched-fused >= 8x sequential at C=50",
            "small-cnn",
            lambda r: _ratio(r, "small-cnn", 50, FUSED),
            8.0,
        ),
        (
            "small-cnn: chosen formulations >= the defaults at C=50 (batched-fused / batched-fused-default)",
            "small-cnn",
            lambda r: _div(_rate(r, "small-cnn", 50, FUSED), _rate(r, "small-cnn", 50, DEFAULTS)),
            1.0,
        ),
        (
            "fedavg-cnn: best batched >= 50% of the device's FLOP/s at C=20",
            "fedavg-cnn",
            lambda r: _frac(r, "fedavg-cnn", 20),
            0.5,
        ),
        (
            "fedavg-cnn: batched-fused >= sequential at C=20",
            "fedavg-cnn",
            lambda r: _ratio(r, "fedavg-cnn", 20, FUSED),
            1.0,
        ),
        (
            "fedavg-cnn: chosen formulations >= the defaults at C=20 (batched-fused / batched-fused-default)",
            "fedavg-cnn",
            lambda r: _div(_rate(r, "fedavg-cnn", 20, FUSED), _rate(r, "fedavg-cnn", 20, DEFAULTS)),
            1.0,
        ),
        (
            "small-cnn: fused update >= 1.3x plain torch at C=50",
            "small-cnn",
            lambda r: _part_ratio(r, "small-cnn", 50),
            1.3,
        ),
    ],
    "cuda": [
        ("small-cnn: >= 1,000,000 client-steps/s at C=1000", "small-cnn", lambda r: _best(r, "small-cnn", 1000), 1e6),
        (
            "small-cnn: no collapse at C=1000 (best >= best at C=200)",
            "small-cnn",
            lambda r: _div(_best(r, "small-cnn", 1000), _best(r, "small-cnn", 200)),
            1.0,
        ),
        (
            "fedavg-cnn: best batched >= 25% of the device's FLOP/s at C>=100",
            "fedavg-cnn",
            lambda r: _max_over(r, "fedavg-cnn", lambda C: _frac(r, "fedavg-cnn", C), 100),
            0.25,
        ),
        (
            "fedavg-cnn: best batched >= 50x sequential at C>=100",
            "fedavg-cnn",
            lambda r: _max_over(
                r, "fedavg-cnn", lambda C: _div(_best(r, "fedavg-cnn", C), _seq(r, "fedavg-cnn", C)), 100
            ),
            50.0,
        ),
        (
            "fedavg-cnn: no collapse at C=200 (best >= best at C=100)",
            "fedavg-cnn",
            lambda r: _div(_best(r, "fedavg-cnn", 200), _best(r, "fedavg-cnn", 100)),
            1.0,
        ),
        (
            "resnet18-gn: best batched >= 4x sequential at C>=16",
            "resnet18-gn",
            lambda r: _max_over(
                r, "resnet18-gn", lambda C: _div(_best(r, "resnet18-gn", C), _seq(r, "resnet18-gn", C)), 16
            ),
            4.0,
        ),
        (
            "resnet18-gn: best batched >= 30% of the device's FLOP/s at C>=16",
            "resnet18-gn",
            lambda r: _max_over(r, "resnet18-gn", lambda C: _frac(r, "resnet18-gn", C), 16),
            0.30,
        ),
        (
            "char-lstm: best batched >= 10x sequential at C=200",
            "char-lstm",
            lambda r: _div(_best(r, "char-lstm", 200), _seq(r, "char-lstm", 200)),
            10.0,
        ),
        (
            "every model: chosen formulations >= the defaults at its largest C",
            "",
            lambda r: _min_over_models(r),
            1.0,
        ),
    ],
}


def _min_over_models(result: Dict[str, Any]) -> Optional[float]:
    """The smallest batched-fused / batched-fused-default ratio over the models, at each one's largest C run."""
    vals: List[float] = []
    for model in result["meta"]["models"]:
        sizes = [C for C in result["meta"]["clients"].get(model, []) if _rate(result, model, C, FUSED) is not None]
        v = _div(_rate(result, model, max(sizes), FUSED), _rate(result, model, max(sizes), DEFAULTS)) if sizes else None
        if v is not None:
            vals.append(v)
    return min(vals) if vals else None


# ------------------------------------------------------------------ host memory
class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mallinfo() -> Optional[Callable[[], int]]:
    """Bytes glibc's malloc has in use (main arena + mmapped), or None off glibc >= 2.33."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def in_use() -> int:
        m = fn()
        return int(m.uordblks + m.hblkhd)

    return in_use


class PeakMemory(TorchDispatchMode):
    """Peak bytes in use while it is active, above what was in use when it started: CUDA's allocator
    statistics, or on a CPU malloc's in-use bytes read after every operator (forward and backward)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.host = _mallinfo() if device.type == "cpu" else None
        self.base = self.top = 0
        self.peak: Optional[int] = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        if self.host is not None:
            self.base = self.top = self.host()
            return super().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            return None
        if self.host is not None:
            super().__exit__(*exc)
            self.peak = self.top - self.base
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.top = max(self.top, self.host())  # set whenever the mode is entered
        return out


# ------------------------------------------------------------------ the workload
class Workload:
    """A round's data and global model for C clients (random, seeded; the same for every mode), and the
    precision its passes compute in."""

    def __init__(
        self,
        setting: Setting,
        clients: int,
        steps: int,
        batch: int,
        device: torch.device,
        seed: int = 0,
        precision: str = "fp32",
    ):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = build_model(setting.model, setting.shape, setting.classes, **setting.kwargs).to(device)
        with torch.no_grad():
            for p in self.model.parameters():  # distinct non-trivial weights, the same in every mode
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(1, p[0].numel()) ** 0.5 if p.dim() > 1 else 0.1))
        self.glob = [p.detach().clone() for p in self.model.parameters()]
        if len(setting.shape) == 1:  # character windows
            self.x = torch.randint(0, setting.classes, (steps, clients, batch, *setting.shape), generator=g).to(device)
        else:
            self.x = torch.randn(steps, clients, batch, *setting.shape, generator=g).to(device)
        self.y = torch.randint(0, setting.classes, (steps, clients, batch), generator=g).to(device)
        self.w = torch.full((steps, clients, batch), 1.0 / batch, device=device)
        self.clients, self.steps, self.device, self.precision = clients, steps, device, precision


def plain_fednar_(
    params: List[torch.Tensor],
    grads: List[torch.Tensor],
    lr: float,
    weight_decay: float,
    max_norm: float,
    eps: float = 1e-6,
) -> None:
    """FedNAR on stacked [C, ...] tensors in plain torch, per client: d = g + wd x, x -= lr min(1, M/(|d|+eps)) d."""
    d = torch._foreach_add(grads, params, alpha=weight_decay)
    sq = torch.stack([t.reshape(t.shape[0], -1).square().sum(1) for t in d]).sum(0)
    coef = (max_norm / (sq.sqrt() + eps)).clamp(max=1.0) * lr
    for p, t in zip(params, d):
        p.sub_(t * coef.view(-1, *([1] * (t.dim() - 1))))


def sequential_round(wl: Workload, opt: FedNAR) -> None:
    model = wl.model
    params = list(model.parameters())
    for c in range(wl.clients):
        with torch.no_grad():
            for p, g in zip(params, wl.glob):
                p.copy_(g)
        opt.start_round()
        for k in range(wl.steps):
            model.zero_grad(set_to_none=True)
            with precision_scope(wl.precision, wl.device):
                with autocast_scope(wl.precision, wl.device):
                    loss = F.cross_entropy(model(wl.x[k, c]), wl.y[k, c])
                loss.backward()
            opt.step()


def plain_round(wl: Workload, loss, stacked: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for s, g in zip(stacked, wl.glob):
            s.copy_(g.unsqueeze(0).expand_as(s))
    for k in range(wl.steps):
        grads, _ = loss.grads(stacked, wl.x[k], wl.y[k], wl.w[k])
        with torch.no_grad():
            plain_fednar_(stacked, list(grads), **HP)


def fused_trainer(wl: Workload, loss, graph: Optional[str], clients: Optional[int] = None) -> BatchedTrainer:
    return BatchedTrainer(
        loss, wl.glob, clients or wl.clients, lambda ps: BatchedFedNAR(ps, **HP), steps=wl.steps, graph=graph
    )


def fused_round(wl: Workload, tr: BatchedTrainer) -> None:
    tr.load(wl.glob)
    tr.start_round(round_index=0)
    for k in range(wl.steps):
        tr.step(wl.x[k], wl.y[k], wl.w[k])


def chunked_round(wl: Workload, tr: BatchedTrainer) -> None:
    """The simulator's ``--client-parallel N`` with N < C: equal chunks of ``tr.clients``, one trainer."""
    n = tr.clients
    for i in range(0, wl.clients, n):
        m = min(n, wl.clients - i)
        active = torch.arange(n, device=wl.device) < m if m < n or tr.graph is not None else None
        tr.load(wl.glob)
        tr.start_round(round_index=0)
        for k in range(wl.steps):
            x, y, w = (_pad_clients(t[k : k + 1, i : i + m], n)[0] for t in (wl.x, wl.y, wl.w))
            tr.step(x, y, w, active=active)


# ------------------------------------------------------------------ counting
def client_step_flops(setting: Setting, batch: int, device: torch.device) -> float:
    """Model FLOPs of one client's local step (forward + backward) at ``batch``: the stacked engine
    with one client, the LSTM written out (torch's fused LSTM kernel is invisible to the counter)."""
    wl = Workload(setting, 1, 1, batch, device)
    engine = StackedLoss(wl.model, formulations={"LSTM": "bmm"} if setting.model == "char-lstm" else None)
    stacked = [g.unsqueeze(0) for g in wl.glob]
    with FlopCounterMode(display=False) as counter:
        engine.grads(stacked, wl.x[0], wl.y[0], wl.w[0])
    return float(counter.get_total_flops())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fused_backend(device: torch.device) -> str:
    return _registry.auto_backend(device, "fednar_batched")


# ------------------------------------------------------------------ one model at one C
def measure(
    name: str, C: int, args: argparse.Namespace, device: torch.device, seq_at: List[int], log: Callable[[str], None]
) -> List[Dict[str, Any]]:
    """Every mode (interleaved) and part of model ``name`` at C clients."""
    setting = SETTINGS[name]
    steps, batch = args.steps_of[name], args.batch_of[name]
    rows: List[Dict[str, Any]] = []
    wl = Workload(setting, C, steps, batch, device, precision=args.precision)
    check_supported(wl.model, wl.precision, device)  # bf16 on a CPU without a kernel for a layer: one clear error
    base = dict(model=name, clients=C, steps=steps, batch=batch)
    chooser = Chooser(
        StackedLoss(wl.model, precision=wl.precision),
        partial(_choice_inputs, wl),
        args.formulations,
        precision=wl.precision,
    )
    _, choice = chooser.plan(C, C, steps, fixed=C, budget_s=args.search_budget)
    rows.append(dict(base, choice=choice.to_json(), search_s=chooser.spent_s, source=choice.source))
    log(f"  {name} C={C:>5} formulations {choice.formulations} ({chooser.spent_s:.1f} s to choose)")
    engine = StackedLoss(wl.model, formulations=choice.formulations, precision=wl.precision)
    default_engine = StackedLoss(wl.model, precision=wl.precision)
    backend = _fused_backend(device)
    graph = "cuda" if device.type == "cuda" and backend != "reference" else None
    builders: Dict[str, Tuple[str, Callable[[], Callable[[], None]]]] = {}
    skipped: Dict[str, str] = {}
    modes = args.modes
    if SEQ in modes:
        if C in seq_at:

            def build_seq():
                opt = FedNAR(wl.model.parameters(), **HP)
                return lambda: sequential_round(wl, opt)

            builders[SEQ] = (_registry.auto_backend(device, "fednar"), build_seq)
        else:
            skipped[SEQ] = f"measured at C={seq_at[0]} (client by client: its rate does not depend on C)"
    # on a GPU the earlier engines (vmap, the update in plain torch) are compared at the smallest C only:
    # the GPU share goes to the engine's own modes at the larger ones
    earlier = device.type == "cpu" or C == min(args.clients_of[name])
    if VMAP in modes and not earlier:
        skipped[VMAP] = "on a GPU at the smallest C only"
    elif VMAP in modes:
        try:
            vmap_loss = ClientLoss(wl.model, precision=wl.precision)
            builders[VMAP] = (backend, lambda: partial(fused_round, wl, fused_trainer(wl, vmap_loss, None)))
        except ValueError as why:
            skipped[VMAP] = str(why).split(". ")[0]
    if PLAIN in modes and not earlier:
        skipped[PLAIN] = "on a GPU at the smallest C only"
    elif PLAIN in modes:

        def build_plain():
            stacked = [g.unsqueeze(0).repeat(C, *([1] * g.dim())).contiguous() for g in wl.glob]
            return lambda: plain_round(wl, engine, stacked)

        builders[PLAIN] = ("torch", build_plain)
    if DEFAULTS in modes:
        builders[DEFAULTS] = (backend, lambda: partial(fused_round, wl, fused_trainer(wl, default_engine, None)))
    if FUSED in modes:
        builders[FUSED] = (backend, lambda: partial(fused_round, wl, fused_trainer(wl, engine, None)))
    if GRAPH in modes and device.type == "cuda":
        if graph is None:  # the reference batched ops read step counters on the host: not capturable
            skipped[GRAPH] = "no fused client-batched backend to capture (reference)"
        else:
            builders[GRAPH] = (backend, lambda: partial(fused_round, wl, fused_trainer(wl, engine, graph)))
    chunk = None
    if CHUNKED in modes and C > 1:
        if args.chunk is not None:
            chunk = math.ceil(C / math.ceil(C / args.chunk)) if C > args.chunk else None
            chunk_forms = choice.formulations if chunk is None else chooser.at(chunk, _budget(args)).formulations
        else:
            fit = _clients_that_fit(wl, device)
            chunk, chunk_choice = chooser.plan(C, fit, steps, budget_s=args.search_budget)
            chunk_forms = chunk_choice.formulations
            chunk = None if chunk >= C else chunk
            rows.append(dict(base, chunk_choice=chunk_choice.to_json(), search_s=chooser.spent_s, fit=fit))
        if chunk is None:
            skipped[CHUNKED] = "all C clients at once was fastest (or --chunk >= C)"
        else:
            chunk_engine = StackedLoss(wl.model, formulations=chunk_forms, precision=wl.precision)
            builders[CHUNKED] = (
                backend,
                lambda: partial(chunked_round, wl, fused_trainer(wl, chunk_engine, graph, chunk)),
            )

    runs: Dict[str, Callable[[], None]] = {}
    info: Dict[str, Dict[str, Any]] = {}
    for mode, (be, build) in builders.items():  # build + one untimed round each, memory measured there
        info[mode] = {"backend": be}
        try:
            with PeakMemory(device) as mem:
                fn = build()
                fn()
            _sync(device)
            runs[mode] = fn
            if mem.peak is not None:
                info[mode]["peak_bytes"] = mem.peak
                info[mode]["peak_bytes_per_client"] = mem.peak if mode == SEQ else mem.peak / C
        except Exception as exc:  # a failing mode is a result, not a crash
            info[mode]["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    times: Dict[str, List[float]] = {m: [] for m in runs}
    loads: Dict[str, List[float]] = {m: [] for m in runs}
    for _ in range(args.rounds):  # interleaved: round r of every mode, then round r + 1
        for mode, fn in list(runs.items()):
            try:
                with OtherLoad() as others:
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    times[mode].append(time.perf_counter() - t0)
                if others.cores is not None:
                    loads[mode].append(others.cores)
            except Exception as exc:
                info[mode]["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                runs.pop(mode)
    for mode in builders:
        row: Dict[str, Any] = dict(base, mode=mode, **info[mode])
        if mode == CHUNKED:
            row["chunk"] = chunk
        if times.get(mode) and "error" not in row:
            row.update(
                round_s=min(times[mode]), round_times_s=times[mode], client_steps_per_s=C * steps / min(times[mode])
            )
            row["other_load_cores"] = max(loads[mode]) if loads[mode] else None
        rows.append(row)
        log(
            f"  {name} C={C:>5} {mode:<22} {row['backend']:<10} "
            + (
                f"{_fmt_rate(row['client_steps_per_s']):>12} client-steps/s"
                if "client_steps_per_s" in row
                else f"ERROR {row.get('error')}"
            )
        )
    for mode, reason in skipped.items():
        rows.append(dict(base, mode=mode, skipped=reason))
    runs.clear()
    gc.collect()

    # parts: the gradients alone (each engine), the update alone on fixed gradients
    stacked = [g.unsqueeze(0).repeat(C, *([1] * g.dim())).contiguous() for g in wl.glob]
    grads = [torch.randn_like(s) * 0.01 for s in stacked]
    parts: List[Tuple[str, str, Callable[[], Any]]] = [
        ("grad stacked", "torch", lambda: engine.grads(stacked, wl.x[0], wl.y[0], wl.w[0])),
        ("grad stacked default", "torch", lambda: default_engine.grads(stacked, wl.x[0], wl.y[0], wl.w[0])),
    ]
    if VMAP in builders:
        parts.append(("grad vmap", "torch", lambda: vmap_loss.grads(stacked, wl.x[0], wl.y[0], wl.w[0])))
    parts.append(("update plain torch", "torch", lambda: plain_fednar_(stacked, grads, **HP)))
    params = [torch.nn.Parameter(s.clone()) for s in stacked]
    opt = BatchedFedNAR(params, **HP)
    for p, g in zip(params, grads):
        p.grad = g
    opt.start_round()
    parts.append(("update fused", backend, opt.step))
    for part, be, fn in parts:
        with OtherLoad() as others, torch.no_grad() if part.startswith("update") else torch.enable_grad():
            ts = time_calls(fn, device, args.part_budget)
        rows.append(dict(base, part=part, backend=be, step_s=median(ts), reps=len(ts), other_load_cores=others.cores))
        log(f"  {name} C={C:>5} part {part:<18} {be:<10} {median(ts) * 1e3:10.3f} ms/step")
    if args.layers and C == max(args.clients_of[name]):
        rows += layer_rows(name, wl, default_engine, args, device, log)
    return rows


def _choice_inputs(wl: Workload, n: int) -> Tuple[List[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the formulation search times for n of the workload's clients: the global model, step 0."""
    params = [g.unsqueeze(0).repeat(n, *([1] * g.dim())).contiguous() for g in wl.glob]
    return params, wl.x[0, :n], wl.y[0, :n], wl.w[0, :n]


def _budget(args: argparse.Namespace) -> SearchBudget:
    return SearchBudget(args.search_budget)


def _clients_that_fit(wl: Workload, device: torch.device) -> int:
    """Clients whose parameters, gradients, state and activations fit in the device's memory budget
    (``sim.parallel.size``: half the free memory on CUDA)."""
    params = sum(g.numel() * g.element_size() for g in wl.glob)
    per_client = params * 6 + 2 * activation_bytes(wl.model, wl.x[0, 0], wl.y[0, 0])
    return max(1, free_bytes(device) // per_client)


def layer_rows(
    name: str,
    wl: Workload,
    engine: StackedLoss,
    args: argparse.Namespace,
    device: torch.device,
    log: Callable[[str], None],
) -> List[Dict[str, Any]]:
    """Forward + backward of every stacked layer alone under each formulation, on its real input."""
    inputs: Dict[str, Tuple[torch.Tensor, bool]] = {}  # the layer's input, and whether it needed a gradient
    hooks = []

    def keep(path: str, args: tuple) -> None:  # a pre-hook that returns something replaces the input
        inputs.setdefault(path, (args[0].detach(), args[0].requires_grad))

    for path, layer in engine.stacked.layers.items():
        hooks.append(layer.register_forward_pre_hook(lambda m, a, path=path: keep(path, a)))
    stacked = [g.unsqueeze(0).repeat(wl.clients, *([1] * g.dim())).contiguous() for g in wl.glob]
    engine.grads(stacked, wl.x[0], wl.y[0], wl.w[0])  # default formulations: the layers' inputs as they run
    default = engine.stacked.formulations()
    for h in hooks:
        h.remove()
    ctx = engine.context(wl.clients, wl.x.shape[2], device)
    slots: Dict[int, List[Tuple[str, torch.Tensor]]] = {id(layer): [] for layer in engine.stacked.layers.values()}
    for (layer, attr), t in zip(engine.stacked.slots, stacked):
        slots[id(layer)].append((attr, t))
    rows = []
    for path, layer in engine.stacked.layers.items():
        if path not in inputs:
            continue
        x, needs_grad = inputs[path]
        forms = layer.candidates(x)
        if len(forms) < 2:
            continue
        x = x.requires_grad_() if needs_grad else x
        ps = {a: t.detach().requires_grad_() for a, t in slots[id(layer)]}
        for form in forms:

            def call(form=form, layer=layer, x=x, ps=ps):
                layer.formulation, layer.params, layer.ctx = form, ps, ctx
                with precision_scope(wl.precision, device):
                    with autocast_scope(wl.precision, device):
                        out = layer(x)
                    out = out[0] if isinstance(out, tuple) else out
                    out.backward(torch.ones_like(out))

            try:
                ts = time_calls(call, device, args.layer_budget)
                rows.append(
                    dict(
                        model=name,
                        clients=wl.clients,
                        layer=path,
                        kind=layer.kind,
                        formulation=form,
                        default=form == default.get(path),
                        step_s=median(ts),
                    )
                )
                log(
                    f"  {name} C={wl.clients} layer {path:<24} {form:<13} {median(ts) * 1e3:9.3f} ms"
                    + ("  (default)" if form == default.get(path) else "")
                )
            except Exception as exc:
                rows.append(
                    dict(
                        model=name,
                        clients=wl.clients,
                        layer=path,
                        kind=layer.kind,
                        formulation=form,
                        error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200],
                    )
                )
        layer.formulation, layer.params = None, {}
    return rows


# ------------------------------------------------------------------ derived figures and goals
def _find(result: Dict[str, Any], model: str, C: int, mode: str) -> Optional[Dict[str, Any]]:
    for r in result["rows"]:
        if r.get("model") == model and r.get("mode") == mode and r["clients"] == C and "client_steps_per_s" in r:
            return r
    return None


def _rate(result: Dict[str, Any], model: str, C: int, mode: str) -> Optional[float]:
    r = _find(result, model, C, mode)
    return None if r is None else r["client_steps_per_s"]


def _seq(result: Dict[str, Any], model: str, C: Optional[int] = None) -> Optional[float]:
    """The sequential rate measured at C (interleaved with that C's modes), else at the first C it ran."""
    rows = [r for r in result["rows"] if r.get("model") == model and r.get("mode") == SEQ and "client_steps_per_s" in r]
    same = [r for r in rows if r["clients"] == C]
    return (same or rows)[0]["client_steps_per_s"] if rows else None


def _best(result: Dict[str, Any], model: str, C: int) -> Optional[float]:
    rates = [v for v in (_rate(result, model, C, m) for m in BATCHED) if v is not None]
    return max(rates) if rates else None


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def _ratio(result: Dict[str, Any], model: str, C: int, mode: str) -> Optional[float]:
    return _div(_rate(result, model, C, mode), _seq(result, model, C))


def _peak(result: Dict[str, Any]) -> Optional[float]:
    peaks = [p["peak_flops_per_s"] for p in result.get("peak", [])]
    return max(peaks) if peaks else None


def _flops(result: Dict[str, Any], model: str) -> Optional[float]:
    return result.get("models", {}).get(model, {}).get("flops_per_client_step")


def _frac(result: Dict[str, Any], model: str, C: int, mode: Optional[str] = None) -> Optional[float]:
    rate = _best(result, model, C) if mode is None else _rate(result, model, C, mode)
    f, peak = _flops(result, model), _peak(result)
    return None if rate is None or f is None or not peak else rate * f / peak


def _max_over(
    result: Dict[str, Any], model: str, value: Callable[[int], Optional[float]], min_c: int
) -> Optional[float]:
    vals = [v for v in (value(C) for C in result["meta"]["clients"].get(model, []) if C >= min_c) if v is not None]
    return max(vals) if vals else None


def _at_largest(result: Dict[str, Any], model: str) -> Optional[float]:
    sizes = [C for C in result["meta"]["clients"].get(model, []) if _best(result, model, C) is not None]
    return _div(_best(result, model, max(sizes)), _seq(result, model, max(sizes))) if sizes else None


def _part(result: Dict[str, Any], model: str, C: int, name: str) -> Optional[float]:
    for r in result["rows"]:
        if r.get("model") == model and r.get("part") == name and r["clients"] == C:
            return r["step_s"]
    return None


def _part_ratio(result: Dict[str, Any], model: str, C: int) -> Optional[float]:
    return _div(_part(result, model, C, "update plain torch"), _part(result, model, C, "update fused"))


def judge(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for text, model, value, threshold in GOALS.get(result["meta"]["device_type"], []):
        if model and model not in result["meta"]["models"]:
            continue
        v = value(result)
        out.append(
            {
                "goal": text,
                "value": v,
                "threshold": threshold,
                "verdict": "n/a" if v is None else ("pass" if v >= threshold else "miss"),
            }
        )
    return out


# ------------------------------------------------------------------ report
def _fmt_rate(v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _fmt_x(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _fmt_bytes(v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"{v / 2**20:,.1f} MiB" if v >= 2**20 else f"{v / 2**10:,.0f} KiB"


def markdown(result: Dict[str, Any]) -> str:
    meta = result["meta"]
    peak = _peak(result)
    lines = [
        f"# Client-batched training — {meta['device_name']} ({meta['date']})",
        "",
        f"- command: `{meta['command']}`",
        f"- commit: `{meta['commit']}`{' (uncommitted changes)' if meta.get('dirty') else ''}; torch {meta['torch']}; "
        f"threads {meta['threads']}; wall time {meta['wall_s']:.0f} s; load average before/after "
        f"{meta.get('loadavg_before')} / {meta.get('loadavg_after')}"
        + (
            "; **interrupted** (deadline): the cases after the last row were not run" if meta.get("interrupted") else ""
        ),
        "- round: C clients x K local steps, FedNAR update; the modes of one C timed interleaved, best of "
        f"{meta['rounds']} rounds after one untimed round; batched backend (auto): {meta['fused_backend']}, "
        f"sequential: {meta['sequential_backend']}",
        f"- precision: {summary(meta.get('precision', 'fp32'))}",
        "- device FLOP/s, measured in this run at that precision (start, end): "
        + "; ".join(
            f"matmul {p['matmul_flops_per_s'] / 1e9:,.1f} G, conv {p['conv_flops_per_s'] / 1e9:,.1f} G"
            + f" ({p.get('dtype', 'float32')}"
            + (", TF32 matmul" if p.get("tf32_matmul") else "")
            + (", TF32 conv" if p.get("tf32_conv") else "")
            + ")"
            for p in result.get("peak", [])
        )
        + (f"; the table uses {peak / 1e9:,.1f} G" if peak else ""),
        "",
        "## Goals",
        "",
        "| goal | value | verdict |",
        "|---|---|---|",
    ]
    for g in result.get("goals", []):
        v = g["value"]
        if v is None:
            shown = "—"
        elif g["threshold"] > 100:
            shown = f"{v:,.0f}"
        elif "FLOP/s" in g["goal"]:
            shown = f"{v:.1%}"
        else:
            shown = f"{v:.3g}x"
        lines.append(f"| {g['goal']} | {shown} | **{g['verdict']}** |")
    for name in meta["models"]:
        m = result["models"][name]
        flops = m.get("flops_per_client_step")
        lines += [
            "",
            f"## {name}",
            "",
            f"{m['paper']}. Inputs {tuple(m['shape'])}, {m['classes']} classes, batch {m['batch']}, "
            f"K={m['steps']} steps per timed round; {m['parameters']:,} parameters; "
            + (f"{flops / 1e6:,.1f} MFLOP per client-step (forward + backward)." if flops else "FLOPs not counted."),
            "",
            "| clients | mode | backend | client-steps/s | vs sequential | model GFLOP/s | of device | "
            "peak memory per client |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for C in meta["clients"][name]:
            seq = _seq(result, name, C)
            for mode in MODES:
                r = next(
                    (
                        r
                        for r in result["rows"]
                        if r.get("model") == name and r.get("mode") == mode and r["clients"] == C
                    ),
                    None,
                )
                if r is None or ("skipped" in r and mode == SEQ):
                    continue
                if "skipped" in r:
                    lines.append(f"| {C} | {mode} | — | not run: {r['skipped']} | | | | |")
                    continue
                if "error" in r:
                    lines.append(f"| {C} | {mode} | {r.get('backend', '')} | error: {r['error'][:80]} | | | | |")
                    continue
                rate = r.get("client_steps_per_s")
                gf = None if rate is None or flops is None else rate * flops
                warn = " ⚠" if (r.get("other_load_cores") or 0) > 0.25 else ""
                label = mode + (f" (chunks of {r['chunk']})" if r.get("chunk") else "")
                lines.append(
                    f"| {C} | {label} | {r['backend']} | {_fmt_rate(rate)}{warn} | "
                    f"{_fmt_x(_div(rate, seq)) if mode != SEQ else '1.00x'} | "
                    f"{'—' if gf is None else f'{gf / 1e9:,.1f}'} | "
                    f"{'—' if gf is None or not peak else f'{gf / peak:.1%}'} | "
                    f"{_fmt_bytes(r.get('peak_bytes_per_client'))}{' (one client)' if mode == SEQ else ''} |"
                )
        lines += [
            "",
            "| clients | grad stacked (chosen) | grad stacked (defaults) | grad vmap | update plain torch | "
            "update fused | update: plain / fused |",
            "|---|---|---|---|---|---|---|",
        ]
        for C in meta["clients"][name]:
            g, d, v, p, f = (
                _part(result, name, C, n)
                for n in ("grad stacked", "grad stacked default", "grad vmap", "update plain torch", "update fused")
            )
            fmt = lambda s: "—" if s is None else f"{s * 1e3:.3f} ms"  # noqa: E731
            lines.append(f"| {C} | {fmt(g)} | {fmt(d)} | {fmt(v)} | {fmt(p)} | {fmt(f)} | {_fmt_x(_div(p, f))} |")
        lines += choice_lines(result, name)
        layer_rows_ = [r for r in result["rows"] if r.get("model") == name and "layer" in r]
        if layer_rows_:
            C = layer_rows_[0]["clients"]
            lines += [
                "",
                f"Layers alone at C={C}, forward + backward (median; **bold**: the default formulation):",
                "",
                "| layer | type | " + " | ".join(("formulation", "time")) + " |",
                "|---|---|---|---|",
            ]
            for r in layer_rows_:
                t = r.get("step_s")
                shown = f"error: {r['error'][:60]}" if "error" in r else f"{t * 1e3:.3f} ms"
                form = f"**{r['formulation']}**" if r.get("default") else r["formulation"]
                lines.append(f"| {r['layer']} | {r['kind']} | {form} | {shown} |")
    lines += [
        "",
        "⚠: other processes kept more than 0.25 cores busy during a timed round of that mode (CPU timings disturbed).",
        "",
    ]
    return "\n".join(lines)


def choice_lines(result: Dict[str, Any], name: str) -> List[str]:
    """The formulations each C ran and why, and the chunk size chosen, as report lines."""
    rows = [r for r in result["rows"] if r.get("model") == name and ("choice" in r or "chunk_choice" in r)]
    if not rows:
        return []
    how = result["meta"].get("formulations", "measure")
    out = [
        "",
        f"Formulations (`--formulations {how}`: each layer group's candidates timed in the whole step, "
        "interleaved medians; a candidate replaces the default when 5% faster):",
        "",
        "| clients | layer | formulation | why |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if "choice" not in r:
            continue
        ch = r["choice"]
        for i, (layer, form) in enumerate(ch["formulations"].items()):
            when = f"{r['clients']} ({r['search_s']:.1f} s to choose)" if i == 0 else ""
            out.append(f"| {when} | {layer} | {form} | {ch['why'].get(layer, '')} |")
    for r in rows:
        if "chunk_choice" in r:
            ch = r["chunk_choice"]
            out.append(
                f"\nC={r['clients']}: chunks of {ch['clients']} clients chosen (at most {r['fit']:,} fit in "
                f"memory; candidates timed per round: chunks x step time)"
            )
    return out


def chart(result: Dict[str, Any], path: Path) -> bool:
    """Client-steps/s against C, a panel per model; False, drawing nothing, without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["meta"]["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        sizes = result["meta"]["clients"][name]
        for mode in MODES:
            pts = [(C, _rate(result, name, C, mode)) for C in sizes]
            if mode == SEQ:
                pts = [(C, _seq(result, name, C)) for C in sizes]
            pts = [(C, v) for C, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode, linestyle="--" if mode == SEQ else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("clients per round (C)")
        ax.set_ylabel("client-steps / s")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"client-batched FedNAR — {result['meta']['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write(result: Dict[str, Any], out_dir: Path) -> Dict[str, Path]:
    """Write ``clients-<device>-<date>[-smoke].{json,md,png}`` into ``out_dir`` and refresh LATEST.md there."""
    from .report import save

    meta = result["meta"]
    stem = f"clients-{meta['device_slug']}-{meta['date']}" + ("-smoke" if meta.get("smoke") else "")
    return save(result, out_dir, stem, markdown, chart)


def render(json_path: Path) -> None:
    """Rewrite the markdown table and chart of a saved result (same numbers, current layout)."""
    from .report import rerender

    rerender(json_path, markdown, chart)


# ------------------------------------------------------------------ command line
def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench clients", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cuda when available)")
    ap.add_argument("--model", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), dest="models")
    ap.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=None,
        help="values of C, for every model (default: each model's list for the device)",
    )
    ap.add_argument("--steps", type=int, default=None, help="local steps K per client (default: each model's)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: each model's paper setting)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per mode, best taken (default %(default)s)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help=f"{CHUNKED}: for C above this, C clients in equal chunks of at most this many, one "
        f"after another (--client-parallel N; CUDA: graph replay) (default: the size the engine chooses "
        f"by measurement among those that fit in memory, as --client-parallel auto)",
    )
    ap.add_argument(
        "--formulations",
        choices=FORMULATION_MODES,
        default="measure",
        help="how each layer's formulation is chosen for the batched modes but batched-fused-default: "
        "measure: timed on this device now; auto: earlier choices of this process or the cache file "
        "first; default: the fixed defaults (default %(default)s)",
    )
    ap.add_argument(
        "--search-budget",
        type=float,
        default=None,
        help="seconds the formulation search may spend per model and C (default: no limit)",
    )
    ap.add_argument(
        "--seq-clients",
        type=int,
        default=None,
        help="run the sequential mode at this C only (default: on a CPU every C up to --seq-max-clients, so each C "
        "compares with a sequential round timed in the same interleaving; on a GPU the smallest C: its rate does "
        "not depend on C)",
    )
    ap.add_argument("--seq-max-clients", type=int, default=200, help="see --seq-clients (default %(default)s)")
    ap.add_argument(
        "--layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time every stacked layer alone under each formulation at the largest C (default on; "
        "the search's step times, in context, are reported either way)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    ap.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="what forward and backward passes compute in, and the device FLOP/s are measured in: fp32 (torch's "
        "defaults), tf32 (CUDA matmuls and convolutions in TF32; a CPU computes fp32), bf16 (autocast; parameters, "
        "gradients and updates float32) (default %(default)s)",
    )
    ap.add_argument("--smoke", action="store_true", help="small-cnn and char-lstm, C in {2, 4}, K=2, one round")
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=ROOT / "bench_runs",
        help="where the result files and LATEST.md go (default: bench_runs/, git-ignored)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--render", type=Path, metavar="RESULT.json", help="only redraw that result's .md and .png")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.chunk is not None and args.chunk < 1:
        ap.error("--chunk must be >= 1")
    if args.search_budget is not None and not args.search_budget > 0:
        ap.error("--search-budget must be > 0")
    if args.clients is not None and any(c < 1 for c in args.clients):
        ap.error("--clients values must be >= 1")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    args.part_budget = PART_BUDGET
    args.layer_budget = Budget(warmup=1, min_reps=3, max_reps=20, min_time_s=0.1)
    if args.smoke:
        if args.models == list(SETTINGS):
            args.models = ["small-cnn", "char-lstm"]
        args.clients, args.rounds = [2, 4], 1
        args.steps = args.steps or 2
        args.part_budget = Budget(warmup=1, min_reps=2, max_reps=2, min_time_s=0.0)
        args.search_budget = args.search_budget or 0.5
        args.layer_budget = Budget(warmup=1, min_reps=1, max_reps=1, min_time_s=0.0)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.render:
        render(args.render)
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        keep_freed_memory()  # as the simulator's client-parallel path does (sim/parallel/host_memory.py)
    kind = "cuda" if device.type == "cuda" else "cpu"
    args.clients_of = {n: args.clients or SETTINGS[n].clients[kind] for n in args.models}
    args.steps_of = {
        n: args.steps or (CPU_STEPS.get(n, SETTINGS[n].steps) if kind == "cpu" else SETTINGS[n].steps)
        for n in args.models
    }
    args.batch_of = {n: args.batch or SETTINGS[n].batch for n in args.models}
    meta = run_meta(
        device,
        "python -m bench clients " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[2:])),
    )
    meta.update(
        mode="clients",
        dtype="float32",
        precision=args.precision,
        smoke=args.smoke,
        models=args.models,
        clients=args.clients_of,
        rounds=args.rounds,
        fused_backend=_fused_backend(device),
        formulations=args.formulations,
        sequential_backend=_registry.auto_backend(device, "fednar"),
        hp=HP,
    )
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"bench clients: {meta['device_name']}, models {args.models}")
    meta["loadavg_before"] = loadavg()
    t0 = time.perf_counter()
    result: Dict[str, Any] = {"meta": meta, "rows": [], "models": {}, "peak": []}
    smoke_peak = 0.05 if args.smoke else 0.5
    result["peak"].append(device_peak(device, min_time_s=smoke_peak, precision=args.precision))
    try:
        seq_of: Dict[str, List[int]] = {}
        for name in args.models:
            s = SETTINGS[name]
            model = build_model(s.model, s.shape, s.classes, **s.kwargs)
            result["models"][name] = dict(
                paper=s.paper,
                shape=list(s.shape),
                classes=s.classes,
                batch=args.batch_of[name],
                steps=args.steps_of[name],
                parameters=sum(p.numel() for p in model.parameters()),
            )
            del model
            sizes = args.clients_of[name]
            if args.seq_clients:
                seq_of[name] = [args.seq_clients]
            elif device.type == "cpu":  # other processes' load moves: compare within each C's interleaving
                seq_of[name] = [C for C in sizes if C <= args.seq_max_clients] or [min(sizes)]
            else:
                seq_of[name] = [min(sizes)]
            args.clients_of[name] = sorted(set(sizes) | set(seq_of[name]))
        # a size at a time: every model's smallest C, then every model's next one, ... the largest last,
        # so that a run cut at its deadline has a row for every model
        for i in range(max(len(v) for v in args.clients_of.values())):
            for name in args.models:
                if i >= len(args.clients_of[name]):
                    continue
                C = args.clients_of[name][i]
                try:
                    if "flops_per_client_step" not in result["models"][name]:
                        result["models"][name]["flops_per_client_step"] = client_step_flops(
                            SETTINGS[name], args.batch_of[name], device
                        )
                    result["rows"] += measure(name, C, args, device, seq_of[name], log)
                except (RuntimeError, ValueError) as exc:  # e.g. out of memory: the next case may still fit
                    result["rows"].append(
                        dict(
                            model=name,
                            clients=C,
                            mode=FUSED,
                            error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                        )
                    )
                    log(f"  {name} C={C}: {result['rows'][-1]['error']}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        result["peak"].append(device_peak(device, min_time_s=smoke_peak, precision=args.precision))
    except KeyboardInterrupt:  # a deadline's SIGINT: keep and write what was measured
        meta["interrupted"] = True
        log("bench clients: interrupted; writing the cases measured so far")
    meta["wall_s"] = time.perf_counter() - t0
    meta["loadavg_after"] = loadavg()
    result["goals"] = judge(result)
    print(markdown(result))
    if not args.no_write:
        paths = write(result, args.out_dir)
        log("wrote " + ", ".join(str(p) for p in paths.values()))
        if "png" not in paths:
            log(
                "bench clients: no chart drawn: matplotlib is not installed (pip install 'fedopt_kernels[bench]' "
                "or pip install matplotlib)"
            )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
