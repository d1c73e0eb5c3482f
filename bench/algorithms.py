"""The benchmarked configurations: which catalogue entry each case runs and what it is compared with.

Every case is an option set of ``fedopt_kernels.fl.catalogue`` (the configurations the tests check),
set up the way a client would before its first step (round inputs, per-step inputs); its memory
traffic comes from the op's declaration (``bench.traffic``). SGD-family cases also name the
``torch.optim.SGD`` keyword arguments that do the same work, for the fused/foreach baselines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from fedopt_kernels.fl import algorithm, catalogue
from fedopt_kernels.core import replay

from .traffic import Traffic

# Backend names of the torch baselines, as they appear in result rows.
TORCH_FUSED = "torch.SGD(fused)"
TORCH_FOREACH = "torch.SGD(foreach)"
TORCH_CLIP_SGD = "torch clip+SGD(fused)"   # what a user writes for FedNAR by hand
TORCH_PROX_SGD = "torch foreach+SGD(fused)"  # proximal term and correction by hand, then SGD (FedDyn)
BASELINES = (TORCH_FUSED, TORCH_FOREACH, TORCH_CLIP_SGD, TORCH_PROX_SGD)
# On a GPU the fused backends replay recorded steps by default (docs/replay.md); each also gets a
# row with replay=False, named "<backend> eager".
REPLAYING = replay.BACKENDS
EAGER = " eager"


def eager_name(backend: str) -> str:
    return backend + EAGER


def base_backend(name: str) -> str:
    """The fedopt backend behind a row's backend name ("cuda eager" -> "cuda")."""
    return name[: -len(EAGER)] if name.endswith(EAGER) else name


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
    config: catalogue.Config
    torch_sgd: Optional[Dict[str, Any]] = None  # comparable torch.optim.SGD kwargs (SGD family)
    clip_sgd: bool = False                      # compared with clip_grad_norm_ + SGD(fused)
    prox_sgd: bool = False                      # compared with foreach gradient terms + SGD(fused)

    def baselines(self) -> List[str]:
        """The torch baselines that do this case's work."""
        if self.torch_sgd is not None:
            return [TORCH_FUSED, TORCH_FOREACH]
        if self.clip_sgd:
            return [TORCH_CLIP_SGD]
        if self.prox_sgd:
            return [TORCH_PROX_SGD]
        return []

    @property
    def traffic(self) -> Traffic:
        return Traffic(self.config.spec.name, self.config.present())

    def build(self, params: List[torch.Tensor], backend: str, replay: Optional[bool] = None) -> Stepper:
        cfg = self.config
        opt = cfg.build(params, backend, replay=replay)
        opt.start_round(**cfg.round_inputs(params, 0, seed=1))
        return Stepper(opt, cfg.step_inputs(params, 0, seed=1))


# every algorithm's benchmark rows, from its descriptor (fedopt_kernels.fl.algorithm), in registration order
ALGOS: Dict[str, Algo] = {
    case.name: Algo(case.name, case.label, catalogue.config(a.name, case.option),
                    dict(case.torch_sgd) if case.torch_sgd is not None else None, case.clip_sgd, case.prox_sgd)
    for a in algorithm.ALGORITHMS.values() for case in a.bench}

# each algorithm's paper configuration; the other rows add traffic options
CORE = [case.name for a in algorithm.ALGORITHMS.values() for case in a.bench if case.core]
FULL = CORE + [name for name in ALGOS if name not in CORE]


def build_torch_sgd(params: List[torch.Tensor], which: str, kwargs: Dict[str, Any]) -> Stepper:
    """torch.optim.SGD with the given work, fused or foreach (``which`` is a BASELINES name)."""
    flag = {"fused": True} if which == TORCH_FUSED else {"foreach": True}
    return Stepper(torch.optim.SGD(params, **kwargs, **flag))


class ClipSGD(Stepper):
    """FedNAR by hand with torch: ``grad += wd * x; clip_grad_norm_(foreach); SGD(fused).step()``."""

    def __init__(self, params: List[torch.Tensor], kwargs: Dict[str, Any]):
        super().__init__(torch.optim.SGD(params, lr=kwargs["lr"], fused=True))
        self.params = params
        self.wd, self.max_norm = kwargs["weight_decay"], kwargs["max_norm"]

    def step(self) -> None:
        grads = [p.grad for p in self.params]
        torch._foreach_add_(grads, self.params, alpha=self.wd)
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.opt.step()


class ProxSGD(Stepper):
    """FedDyn by hand with torch: ``grad += alpha * (x - x0) - g_i`` (foreach ops), then
    ``SGD(fused)`` with the same momentum, dampening and weight decay."""

    def __init__(self, params: List[torch.Tensor], kwargs: Dict[str, Any]):
        sgd = {k: kwargs[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov") if k in kwargs}
        super().__init__(torch.optim.SGD(params, **sgd, fused=True))
        self.params, self.alpha = params, kwargs["alpha"]
        self.x0 = [p.detach().clone() for p in params]
        self.g_i = [torch.randn_like(p) for p in params]

    def step(self) -> None:
        grads = [p.grad for p in self.params]
        torch._foreach_add_(grads, self.params, alpha=self.alpha)
        torch._foreach_add_(grads, self.x0, alpha=-self.alpha)
        torch._foreach_sub_(grads, self.g_i)
        self.opt.step()


def build_baseline(algo: Algo, params: List[torch.Tensor], which: str) -> Stepper:
    if which == TORCH_CLIP_SGD:
        return ClipSGD(params, dict(algo.config.kwargs))
    if which == TORCH_PROX_SGD:
        return ProxSGD(params, dict(algo.config.kwargs))
    return build_torch_sgd(params, which, algo.torch_sgd)
