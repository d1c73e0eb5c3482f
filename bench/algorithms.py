"""The benchmarked configurations: which catalogue entry each case runs and what it is compared with.

Every case is an option set of ``fedopt_kernels.fl.catalogue`` (the configurations the tests check),
set up the way a client would before its first step (round inputs, per-step inputs); its memory
traffic comes from the op's declaration (``bench.traffic``). ``bench/cases.py`` declares each
algorithm's rows (``BenchCase``) and, beside each, the torch code a user would write for the same
work (``Baseline``: ``torch.optim.SGD`` fused / foreach, clip_grad_norm_ + SGD, ...). Everything here
is read from the registry and those rows when asked for, so an algorithm registered at any time has its rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from fedopt_kernels.core import replay
from fedopt_kernels.fl import algorithm, catalogue

from . import cases
from .cases import TORCH_FOREACH, TORCH_FUSED, Baseline, BenchCase
from .traffic import Traffic

# Backend names of torch.optim.SGD's rows (bench/cases.py), which names the other baselines too.
# On a GPU the fused backends replay recorded steps by default (docs/replay.md); each also gets a
# row with replay=False, named "<backend> eager".
REPLAYING = replay.BACKENDS
EAGER = " eager"


def eager_name(backend: str) -> str:
    return backend + EAGER


def base_backend(name: str) -> str:
    """The fedopt backend behind a row's backend name ("cuda eager" -> "cuda")."""
    return name[: -len(EAGER)] if name.endswith(EAGER) else name


def _no_new_gradient() -> None:
    """The closure of a step that takes one (FedSAM): the benchmark times the optimizer's work on the
    gradients it has, so the second gradient is the first."""


@dataclass
class Stepper:
    """An optimizer plus the arguments its step() needs (e.g. PAdaMFed's anchor gradients)."""

    opt: torch.optim.Optimizer
    step_kwargs: Dict[str, Any] = field(default_factory=dict)

    def step(self) -> None:
        self.opt.step(**self.step_kwargs)


@dataclass(frozen=True)
class BenchAlgo:
    name: str
    label: str
    config: catalogue.Config
    baseline_of: Mapping[str, Baseline] = field(default_factory=dict)  # row name -> baseline
    case: Optional[BenchCase] = None  # its declaration (what its step moves besides its op)

    def baselines(self) -> List[str]:
        """The torch baselines that do this case's work."""
        return list(self.baseline_of)

    @property
    def by_hand(self) -> Optional[str]:
        """The baseline a user would write by hand for this work (the "x by hand" column), if any."""
        return next((n for n, b in self.baseline_of.items() if b.by_hand), None)

    @property
    def traffic(self) -> Traffic:
        also, streams = (self.case.also, self.case.streams) if self.case is not None else ((), 0)
        return Traffic(self.config.spec.name, self.config.present(), also, streams)

    def baseline_traffic(self, name: str) -> Traffic:
        t = self.baseline_of[name].traffic
        return self.traffic if t is None else Traffic(t[0], t[1])

    def baseline_kwargs(self, name: str) -> Mapping[str, Any]:
        b = self.baseline_of[name]
        return self.config.kwargs if b.kwargs is None else b.kwargs

    def step_kwargs(self, params: List[torch.Tensor]) -> Dict[str, Any]:
        kwargs = self.config.step_inputs(params, 0, seed=1)
        if "closure" in kwargs:
            kwargs["closure"] = _no_new_gradient
        return kwargs

    def build(self, params: List[torch.Tensor], backend: str, replay: Optional[bool] = None) -> Stepper:
        cfg = self.config
        opt = cfg.build(params, backend, replay=replay)
        opt.start_round(**cfg.round_inputs(params, 0, seed=1))
        return Stepper(opt, self.step_kwargs(params))


def _cases() -> Dict[str, BenchAlgo]:
    return {
        case.name: BenchAlgo(
            case.name, case.label, catalogue.config(a.name, case.option), {b.name: b for b in case.baselines}, case
        )
        for a in algorithm.ALGORITHMS.values()
        for case in cases.of(a.name)
    }


class _Cases(Mapping[str, BenchAlgo]):
    """Every algorithm's benchmark rows (``bench/cases.py``), in registration order (read when asked)."""

    def __getitem__(self, name: str) -> BenchAlgo:
        return _cases()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(_cases()))

    def __len__(self) -> int:
        return len(_cases())


ALGOS: Mapping[str, BenchAlgo] = _Cases()


def core_cases() -> List[str]:
    """Each algorithm's paper configuration (the default table)."""
    return [case.name for a in algorithm.ALGORITHMS.values() for case in cases.of(a.name) if case.core]


def all_cases() -> List[str]:
    return core_cases() + [name for name in ALGOS if name not in core_cases()]


def baseline_names() -> Tuple[str, ...]:
    """Every baseline's row name."""
    return tuple(dict.fromkeys(n for a in ALGOS.values() for n in a.baselines()))


def __getattr__(name: str) -> Any:
    # CORE, FULL and BASELINES as they are when imported (the functions above read the registry anew)
    if name == "CORE":
        return core_cases()
    if name == "FULL":
        return all_cases()
    if name == "BASELINES":
        return baseline_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_baseline(algo: BenchAlgo, params: List[torch.Tensor], which: str) -> Stepper:
    """Baseline ``which`` of ``algo`` on ``params``, stepped as the fused row is (a closure where it takes one)."""
    opt = algo.baseline_of[which].build(params, algo.baseline_kwargs(which))
    closure = {"closure": _no_new_gradient} if "closure" in algo.step_kwargs(params) else {}
    return Stepper(opt, closure)


__all__ = [
    "ALGOS",
    "BenchAlgo",
    "Stepper",
    "TORCH_FUSED",
    "TORCH_FOREACH",
    "EAGER",
    "REPLAYING",
    "build_baseline",
    "core_cases",
    "all_cases",
    "baseline_names",
    "eager_name",
    "base_backend",
]
