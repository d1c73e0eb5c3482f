"""The benchmarked configurations: how to build each optimizer and what it is compared with.

Each ``Algo`` builds a ready-to-step optimizer over given parameters (state such as control
variates and neuron scales is set up the way a client would before its first step) and states
its memory traffic (``bench.traffic``). SGD-family configurations also name the
``torch.optim.SGD`` keyword arguments that do the same work, for the fused/foreach baselines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

import fedopt_kernels as fk

from .traffic import Traffic

LR = 1e-3
WD = 5e-4

# Backend names of the torch.optim.SGD baselines, as they appear in result rows.
TORCH_FUSED = "torch.SGD(fused)"
TORCH_FOREACH = "torch.SGD(foreach)"
BASELINES = (TORCH_FUSED, TORCH_FOREACH)


@dataclass
class Stepper:
    """An optimizer plus the arguments its step() needs (e.g. PAdaMFed's anchor gradients)."""

    opt: torch.optim.Optimizer
    step_kwargs: Dict[str, Any] = field(default_factory=dict)

    def step(self) -> None:
        self.opt.step(**self.step_kwargs)


@dataclass(frozen=True)
class Algo:
    name: str
    label: str
    traffic: Traffic
    build: Callable[[List[torch.Tensor], str], Stepper]
    torch_sgd: Optional[Dict[str, Any]] = None  # comparable torch.optim.SGD kwargs (SGD family)


def _like(params: List[torch.Tensor], scale: float = 1e-3) -> List[torch.Tensor]:
    return [torch.randn_like(p) * scale for p in params]


def _feddecay(momentum: float, wd: float, scaffold_prox: bool = False) -> Callable[[List[torch.Tensor], str], Stepper]:
    def build(params: List[torch.Tensor], backend: str) -> Stepper:
        opt = fk.FedDecaySGD(params, lr=LR, beta=0.9, momentum=momentum, weight_decay=wd,
                             prox_mu=0.01 if scaffold_prox else 0.0, backend=backend)
        opt.start_round(correction=_like(params) if scaffold_prox else None)
        return Stepper(opt)
    return build


def _neuronlr(params: List[torch.Tensor], backend: str) -> Stepper:
    opt = fk.NeuronLRSGD(params, lr=LR, momentum=0.9, weight_decay=WD, backend=backend)
    gen = torch.Generator().manual_seed(1)
    scales = {p: (0.5 + torch.rand(p.shape[0], generator=gen)).to(p.device) for p in params if p.dim() > 0}
    opt.start_round(neuron_scales=scales)
    return Stepper(opt)


def _fednar(scaffold_prox: bool) -> Callable[[List[torch.Tensor], str], Stepper]:
    def build(params: List[torch.Tensor], backend: str) -> Stepper:
        opt = fk.FedNAR(params, lr=LR, weight_decay=WD, max_norm=10.0,
                        prox_mu=0.01 if scaffold_prox else 0.0, backend=backend)
        opt.start_round(correction=_like(params) if scaffold_prox else None)
        return Stepper(opt)
    return build


def _padamfed(vr: bool) -> Callable[[List[torch.Tensor], str], Stepper]:
    def build(params: List[torch.Tensor], backend: str) -> Stepper:
        opt = fk.PAdaMFed(params, lr=LR, beta=0.5, variance_reduction=vr, backend=backend)
        opt.start_round(global_control=_like(params), local_control=_like(params), momentum=_like(params))
        kwargs = {"anchor_grads": [torch.randn_like(p) for p in params]} if vr else {}
        return Stepper(opt, kwargs)
    return build


ALGOS: Dict[str, Algo] = {a.name: a for a in [
    Algo("feddecay", "FedDecaySGD momentum=0.9 wd", Traffic("sgd", momentum=True),
         _feddecay(0.9, WD), torch_sgd=dict(momentum=0.9, weight_decay=WD)),
    Algo("feddecay_plain", "FedDecaySGD no momentum", Traffic("sgd"),
         _feddecay(0.0, 0.0), torch_sgd=dict(momentum=0.0, weight_decay=0.0)),
    Algo("feddecay_scaffold_prox", "FedDecaySGD momentum + SCAFFOLD + FedProx",
         Traffic("sgd", momentum=True, correction=True, prox=True), _feddecay(0.9, WD, scaffold_prox=True)),
    Algo("neuronlr", "NeuronLRSGD momentum=0.9 wd, scales on every tensor",
         Traffic("sgd", momentum=True, neuron_scale=True), _neuronlr,
         torch_sgd=dict(momentum=0.9, weight_decay=WD)),
    Algo("fednar", "FedNAR wd max_norm=10", Traffic("fednar", weight_decay=True), _fednar(False)),
    Algo("fednar_scaffold_prox", "FedNAR + SCAFFOLD + FedProx",
         Traffic("fednar", weight_decay=True, correction=True, prox=True), _fednar(True)),
    Algo("padamfed", "PAdaMFed beta=0.5", Traffic("padamfed"), _padamfed(False)),
    Algo("padamfed_vr", "PAdaMFed variance reduction", Traffic("padamfed", variance_reduction=True), _padamfed(True)),
]}

# The four paper algorithms in their common configuration; the variants add traffic options.
CORE = ["feddecay", "neuronlr", "fednar", "padamfed"]
FULL = CORE + ["feddecay_plain", "feddecay_scaffold_prox", "fednar_scaffold_prox", "padamfed_vr"]


def build_torch_sgd(params: List[torch.Tensor], which: str, kwargs: Dict[str, Any]) -> Stepper:
    """torch.optim.SGD with the given work, fused or foreach (``which`` is a BASELINES name)."""
    flag = {"fused": True} if which == TORCH_FUSED else {"foreach": True}
    return Stepper(torch.optim.SGD(params, lr=LR, **kwargs, **flag))
