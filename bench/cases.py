"""What the benchmark runs for each algorithm (``BenchCase``: a catalogue option set) and the torch
code a user would write for the same work beside it (``Baseline``), by algorithm name.

Each row runs an option set of the algorithm's descriptor (``fedopt_kernels.fl.catalogue``); its
bytes per step come from the op's declaration (``bench.traffic``), plus what a row declares its step
moves besides (FedSAM's ascent op and its restore of x). An algorithm that declares no rows has one,
its first option set (the paper configuration) in the default table, with no baseline; one that
has torch code to be timed against, more option sets or traffic of its own declares its rows with
``add``. ``bench.algorithms`` reads them when asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

# the benchmark's rows of torch.optim.SGD: the step a user has today
TORCH_FUSED = "torch.SGD(fused)"
TORCH_FOREACH = "torch.SGD(foreach)"

OpRoles = Tuple[str, Tuple[str, ...]]  # an op and the optional roles a step uses


@dataclass(frozen=True)
class Baseline:
    """What a user would write by hand with torch for one benchmark row's work, timed beside the fused
    step (``python -m bench``).

    ``build(params, kwargs)`` returns a ``torch.optim.Optimizer`` whose ``step(closure=None)`` does that
    work (its gradients are already in ``p.grad``); ``kwargs`` are the row's option set's constructor
    keywords, or ``kwargs`` given here. ``traffic``:
    ``(op, optional roles)`` whose bytes per element the row is counted at (None: the algorithm's
    own; torch's SGD counts at plain SGD's). ``by_hand``: the row's "x by hand" speedup is over this
    one (torch's SGD is the step a user has today, shown in columns of its own).
    """

    name: str
    build: Callable[[List[torch.Tensor], Mapping[str, Any]], torch.optim.Optimizer]
    kwargs: Optional[Mapping[str, Any]] = None
    traffic: Optional[OpRoles] = None
    by_hand: bool = True


@dataclass(frozen=True)
class BenchCase:
    """One benchmark row of an algorithm (``python -m bench``): catalogue option set ``option``.

    ``core``: in the default table (the paper configuration); ``baselines``: the torch code that
    does the same work (``Baseline``), timed beside it. ``also``: other ops a step runs, with their
    optional roles (FedSAM's ascent); ``streams``: element streams it moves besides the ops', in the
    parameters' dtype (FedSAM's restore of x: a read and a write).
    """

    name: str
    label: str
    option: str
    core: bool = False
    baselines: Tuple[Baseline, ...] = ()
    also: Tuple[OpRoles, ...] = ()
    streams: int = 0


# ---------------------------------------------------------------------------- what a user writes instead
def _torch_sgd(flag: str):
    def build(params: List[torch.Tensor], kwargs: Mapping[str, Any]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, **kwargs, **{flag: True})

    return build


def torch_sgd(**kwargs: Any) -> Tuple[Baseline, ...]:
    """``torch.optim.SGD(fused=True)`` and ``(foreach=True)`` with ``kwargs``: benchmark baselines for a
    row whose work plain SGD does too (counted at plain SGD's bytes per element)."""
    traffic = ("sgd", ("momentum_buffer",) if kwargs.get("momentum", 0) else ())
    return tuple(
        Baseline(name, _torch_sgd(flag), kwargs=dict(kwargs), traffic=traffic, by_hand=False)
        for name, flag in ((TORCH_FUSED, "fused"), (TORCH_FOREACH, "foreach"))
    )


class ClipSGD(torch.optim.SGD):
    """FedNAR as a user writes it with torch (the benchmark's baseline): ``grad += weight_decay * x``,
    ``clip_grad_norm_(max_norm, foreach=True)``, then ``SGD(fused=True)``."""

    def __init__(self, params: List[torch.Tensor], kwargs: Mapping[str, Any]):
        super().__init__(params, lr=kwargs["lr"], fused=True)
        self.params = list(params)
        self.wd, self.max_norm = kwargs["weight_decay"], kwargs["max_norm"]

    def step(self, closure=None):
        grads = [p.grad for p in self.params]
        torch._foreach_add_(grads, self.params, alpha=self.wd)
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        return super().step(closure)


class ProxSGD(torch.optim.SGD):
    """FedDyn as a user writes it with torch (the benchmark's baseline): ``grad += alpha * (x - x0) - g_i``
    with foreach ops, then ``SGD(fused=True)`` with the same momentum, dampening and weight decay."""

    def __init__(self, params: List[torch.Tensor], kwargs: Mapping[str, Any]):
        sgd = {k: kwargs[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov") if k in kwargs}
        super().__init__(params, **sgd, fused=True)
        self.params, self.alpha = list(params), kwargs["alpha"]
        self.x0 = [p.detach().clone() for p in params]
        self.g_i = [torch.randn_like(p) for p in params]

    def step(self, closure=None):
        grads = [p.grad for p in self.params]
        torch._foreach_add_(grads, self.params, alpha=self.alpha)
        torch._foreach_add_(grads, self.x0, alpha=-self.alpha)
        torch._foreach_sub_(grads, self.g_i)
        return super().step(closure)


class PlainSAM(torch.optim.SGD):
    """SAM as a user writes it with torch (the benchmark's baseline; the usual two-pass implementation):
    ``e = rho * g / (||g|| + eps)`` by foreach ops, ``x += e``, the closure, ``x -= e``, then
    ``SGD(fused=True)`` with the same momentum and weight decay."""

    def __init__(self, params: List[torch.Tensor], kwargs: Mapping[str, Any]):
        sgd = {k: kwargs[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov") if k in kwargs}
        super().__init__(params, **sgd, fused=True)
        self.params, self.rho = list(params), kwargs.get("rho", 0.05)

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for p in self.params]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        e = torch._foreach_mul(grads, self.rho / (norm + 1e-12))
        torch._foreach_add_(self.params, e)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        torch._foreach_sub_(self.params, e)
        super().step()  # torch's wrapper around SGD.step: hooks, no grad
        return loss


# ---------------------------------------------------------------------------- the rows, by algorithm
_CASES: Dict[str, Tuple[BenchCase, ...]] = {}


def add(algorithm: str, *cases: BenchCase) -> None:
    """Declare the benchmark rows of registered algorithm ``algorithm`` (once per algorithm)."""
    if algorithm in _CASES:
        raise ValueError(f"algorithm {algorithm!r} has its benchmark rows already")
    _CASES[algorithm] = tuple(cases)


def withdraw(algorithm: str) -> None:
    """Remove the rows of ``algorithm`` (a test's algorithm)."""
    del _CASES[algorithm]


def of(algorithm: str) -> Tuple[BenchCase, ...]:
    """The rows of ``algorithm``: those it declared, else its default row (``default_case``); none for
    a name no algorithm registered."""
    declared = _CASES.get(algorithm)
    if declared is not None:
        return declared
    default = default_case(algorithm)
    return () if default is None else (default,)


def default_case(algorithm: str) -> Optional[BenchCase]:
    """The row of registered algorithm ``algorithm`` that declares none: its first option set (the
    paper configuration), in the default table; None for a name no algorithm registered."""
    from fedopt_kernels.fl.algorithm import ALGORITHMS

    a = ALGORITHMS.get(algorithm)
    if a is None or not a.options:
        return None
    option = next(iter(a.options))
    return BenchCase(a.name, f"{a.optimizer.__name__} ({option})", option, core=True)


add(
    "feddecay",
    BenchCase(
        "feddecay",
        "FedDecaySGD momentum=0.9 wd",
        "momentum_wd",
        core=True,
        baselines=torch_sgd(lr=0.05, momentum=0.9, weight_decay=5e-4),
    ),
    BenchCase("feddecay_plain", "FedDecaySGD no momentum", "plain", baselines=torch_sgd(lr=0.1)),
    BenchCase("feddecay_scaffold_prox", "FedDecaySGD momentum + SCAFFOLD + FedProx", "prox_correction"),
)
add(
    "neuron_lr",
    BenchCase(
        "neuronlr",
        "NeuronLRSGD momentum=0.9 wd, scales on every tensor",
        "every_row",
        core=True,
        baselines=torch_sgd(lr=0.05, momentum=0.9, weight_decay=5e-4),
    ),
)
add(
    "fednar",
    BenchCase(
        "fednar",
        "FedNAR wd max_norm=10",
        "wd",
        core=True,
        baselines=(Baseline("torch clip+SGD(fused)", ClipSGD),),
    ),
    BenchCase("fednar_scaffold_prox", "FedNAR + SCAFFOLD + FedProx", "prox_correction"),
)
add(
    "padamfed",
    BenchCase("padamfed", "PAdaMFed beta=0.3, controls", "controls", core=True),
    BenchCase("padamfed_vr", "PAdaMFed variance reduction", "vr"),
)
add(
    "feddyn",
    BenchCase(
        "feddyn",
        "FedDyn momentum=0.9 (alpha (x - x0) and -g_i)",
        "momentum",
        core=True,
        baselines=(Baseline("torch foreach+SGD(fused)", ProxSGD),),
    ),
)
add(
    "fedsam",
    BenchCase(
        "fedsam",
        "FedSAM rho=0.05 momentum=0.9 wd (ascent + descent)",
        "momentum_wd",
        core=True,
        baselines=(Baseline("torch SAM(two-pass)+SGD(fused)", PlainSAM),),
        also=(("sam_ascent", ("saved_x",)),),  # the ascent
        streams=2,  # the restore: read saved x, write x
    ),
)
