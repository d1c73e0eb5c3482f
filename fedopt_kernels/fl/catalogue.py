"""The catalogue of optimizer configurations every check reads (like torch's ``optim_db``).

Each algorithm lists named option sets; each option set says how to build the optimizer on given
parameters and what a client would hand it per round (SCAFFOLD corrections, FedNLR scales,
PAdaMFed controls) and per step (PAdaMFed-VR anchor gradients), from seeds, so that two runs on
two backends see exactly the same inputs. The equivalence harness, the property tests, the
self-check, the torch.compile / AMP tests and the benchmark all take their configurations from
here. The option sets themselves are part of each algorithm's descriptor
(``fedopt_kernels.fl.algorithm``), read when asked for (``ALGOS`` is a live view of the registry):
an algorithm registered there, whenever that happens, is covered by every check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type

import torch

from ..core.ops import OpSpec
from ..core.optimizer import FedOptimizer
from . import algorithm

Tensors = List[torch.Tensor]
# parameters read, never changed in length: a list of nn.Parameter is one (a List would refuse it)
Params = Sequence[torch.Tensor]


def rand_like_list(params: Params, seed: int, scale: float = 0.1, dtype: Optional[torch.dtype] = None) -> Tensors:
    """Seeded random tensors shaped like ``params`` (on their devices)."""
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(p.shape, generator=g)).to(dtype=dtype or p.dtype, device=p.device) for p in params]


def scales_for(params: Params, seed: int, every: bool = False) -> Dict[torch.Tensor, torch.Tensor]:
    """Positive per-row scales for two thirds of the parameters that have rows (all of them: ``every``)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, p in enumerate(params):
        if p.dim() >= 1 and (every or i % 3 != 2):
            dt = torch.float64 if p.dtype == torch.float64 else torch.float32
            out[p] = (0.5 + torch.rand(p.shape[0], generator=g)).to(dtype=dt, device=p.device)
    return out


class SecondGradient:
    """The closure a catalogue step that takes one gets (FedSAM's): it sets each parameter's gradient
    to ``base + x``, seeded noise plus the parameter as it is then, so that where the step moved the
    parameters before calling it shows in what the step does next. It writes into the gradient
    tensors there are (the bits of ``base + x``), as a backward does into kept gradients, and as
    the caching allocator makes of ``zero_grad(set_to_none=True)`` and a backward: the second
    gradients sit where the first did."""

    def __init__(self, params: Tensors, bases: Tensors):
        self.params, self.bases = params, bases

    def __call__(self) -> None:
        for p, b in zip(self.params, self.bases, strict=True):
            g = p.grad
            if g is not None:
                g.copy_(b).add_(p.detach())


@dataclass(frozen=True)
class Config:
    """One option set of one algorithm.

    ``kwargs``: constructor hyperparameters. ``groups``: overrides for a second param group (the
    odd-indexed parameters); ``correction``: a SCAFFOLD correction each round; ``scales``: FedNLR
    scales each round (for two thirds of the parameters, or ``"every"`` parameter with rows);
    ``controls``: PAdaMFed controls and momentum each round.
    """

    algo: str
    option: str
    cls: Type[FedOptimizer]
    kwargs: Mapping[str, Any]
    groups: Optional[Mapping[str, Any]] = None
    correction: bool = False
    scales: Any = False
    controls: bool = False

    @property
    def spec(self) -> OpSpec:
        return self.cls.op_spec()

    def param_groups(self, params: Params) -> List[Dict[str, Any]]:
        if not self.groups:
            return [{"params": list(params)}]
        return [{"params": list(params[0::2])}, {"params": list(params[1::2]), **self.groups}]

    def build(self, params: Params, backend: str = "auto", replay: Optional[bool] = None) -> FedOptimizer:
        return self.cls(self.param_groups(params), backend=backend, replay=replay, **self.kwargs)

    def build_batched(self, params: Params, backend: str = "auto", replay: Optional[bool] = None) -> FedOptimizer:
        """The client-batched form over stacked parameters ``[C, *shape]``."""
        return algorithm.of_optimizer(self.cls).batched(
            self.param_groups(params), backend=backend, replay=replay, **self.kwargs
        )

    def batched_round_inputs(self, clients: List[Tensors], stacked: Tensors, rnd: int, seed: int = 0) -> Dict[str, Any]:
        """Client c's ``round_inputs(clients[c], rnd, seed + 100 c)``, stacked for ``stacked`` params."""
        per = [self.round_inputs(ps, rnd, seed + 100 * c) for c, ps in enumerate(clients)]
        out: Dict[str, Any] = {}
        for key in per[0] if per else ():
            if isinstance(per[0][key], dict):  # neuron scales {param: r}: the same parameters for every client
                index = [{id(p): i for i, p in enumerate(ps)} for ps in clients]
                out[key] = {
                    stacked[index[0][id(p)]]: torch.stack(
                        [per[c][key][clients[c][index[0][id(p)]]] for c in range(len(clients))]
                    )
                    for p in per[0][key]
                }
            else:
                out[key] = [torch.stack([per[c][key][i] for c in range(len(clients))]) for i in range(len(stacked))]
        return out

    def batched_step_inputs(
        self, clients: List[Tensors], step: int, seed: int = 0, stacked: Optional[Tensors] = None
    ) -> Dict[str, Any]:
        """Client c's ``step_inputs(clients[c], step, seed + 100 c)``, stacked; a closure's seeded
        gradients too, on ``stacked`` (the client-batched parameters; by default the tensors that
        ``clients[c]``, views ``stacked[i][c]``, view)."""
        per = [self.step_inputs(ps, step, seed + 100 * c) for c, ps in enumerate(clients)]
        out: Dict[str, Any] = {}
        for key in per[0] if per else ():
            if isinstance(per[0][key], SecondGradient):
                if stacked is None:
                    bases = [t._base for t in clients[0]]
                    if any(t is None or t.shape[0] != len(clients) for t in bases):
                        raise ValueError("a step with a closure needs the stacked parameters (stacked=...)")
                    stacked = [t for t in bases if t is not None]
                seeded = [torch.stack([per[c][key].bases[i] for c in range(len(clients))]) for i in range(len(stacked))]
                out[key] = SecondGradient(list(stacked), seeded)
            else:
                out[key] = [torch.stack([per[c][key][i] for c in range(len(clients))]) for i in range(len(clients[0]))]
        return out

    def round_inputs(self, params: Tensors, rnd: int, seed: int = 0) -> Dict[str, Any]:
        """``start_round`` inputs of round ``rnd`` (``params`` in the optimizer's order)."""
        out: Dict[str, Any] = {}
        if self.correction:
            out["correction"] = rand_like_list(params, seed + 17 * rnd)
        if self.scales:
            out["neuron_scales"] = scales_for(params, seed + rnd, every=self.scales == "every")
        if self.controls:
            out["global_control"] = rand_like_list(params, seed + 31 * rnd, dtype=torch.float32)
            out["local_control"] = rand_like_list(params, seed + 37 * rnd + 1)
            out["momentum"] = rand_like_list(params, seed + 41 * rnd + 2)
        return out

    def step_inputs(self, params: Tensors, step: int, seed: int = 0) -> Dict[str, Any]:
        """``step`` keyword inputs of global step ``step`` (the algorithm's descriptor makes them; a
        step that takes a closure gets a ``SecondGradient``)."""
        a = algorithm.of_optimizer(self.cls)
        out = a.step_inputs(self.kwargs, params, seed + 7 * step + 3)
        if a.closure_step:
            out["closure"] = SecondGradient(list(params), rand_like_list(params, seed + 7 * step + 5, 1.0))
        return out

    def present(self) -> Tuple[str, ...]:
        """The optional roles of the op this configuration's steps use (for traffic figures)."""
        return algorithm.of_optimizer(self.cls).present(self.kwargs, self.correction, self.scales)


@dataclass
class Algo:
    name: str
    cls: Type[FedOptimizer]
    options: Dict[str, Config] = field(default_factory=dict)
    full: str = ""  # the option set that exercises every role of the op

    @property
    def op(self) -> str:
        return self.cls.op_spec().name


def _algo(name: str, cls: Type[FedOptimizer], full: str, options: Mapping[str, Mapping[str, Any]]) -> Algo:
    algo = Algo(name, cls, full=full)
    for opt_name, spec in options.items():
        spec = dict(spec)
        flags = {k: spec.pop(k, False) for k in ("correction", "scales", "controls")}
        groups = spec.pop("groups", None)
        algo.options[opt_name] = Config(name, opt_name, cls, spec, groups=groups, **flags)
    return algo


class _Catalogue(Mapping[str, Algo]):
    """Every registered algorithm's option sets, by algorithm name, read from the registry when asked."""

    def __init__(self) -> None:
        self._made: Dict[str, Tuple[algorithm.Algorithm, Algo]] = {}

    def __getitem__(self, name: str) -> Algo:
        a = algorithm.ALGORITHMS[name]
        made = self._made.get(name)
        if made is None or made[0] is not a:
            made = self._made[name] = (a, _algo(a.name, a.optimizer, a.full, a.options))
        return made[1]

    def __iter__(self) -> Iterator[str]:
        return iter(list(algorithm.ALGORITHMS))

    def __len__(self) -> int:
        return len(algorithm.ALGORITHMS)


ALGOS: Mapping[str, Algo] = _Catalogue()


def config(algo: str, option: Optional[str] = None) -> Config:
    """``ALGOS[algo].options[option]`` (the algorithm's full option set by default)."""
    a = ALGOS[algo]
    return a.options[option or a.full]


def run(
    cfg: Config,
    params: Tensors,
    backend: str,
    rounds: int = 2,
    steps: int = 3,
    seed: int = 0,
    grads: Optional[Callable[[Tensors, int], List[Optional[torch.Tensor]]]] = None,
) -> FedOptimizer:
    """``rounds`` x ``steps`` steps of ``cfg`` on ``params`` with seeded gradients; returns the optimizer.

    ``grads(params, global_step)`` replaces the default seeded standard-normal gradients.
    """
    opt = cfg.build(params, backend)
    ordered = [p for g in opt.param_groups for p in g["params"]]
    for rnd in range(rounds):
        if rnd > 0:  # the previous round ends when the next one starts; the last one stays open
            algorithm.end_round(opt)
        opt.start_round(**cfg.round_inputs(ordered, rnd, seed))
        for step in range(steps):
            gstep = rnd * steps + step
            new = grads(params, gstep) if grads is not None else rand_like_list(params, seed * 1000 + gstep, 1.0)
            for p, g in zip(params, new, strict=True):
                p.grad = g
            opt.step(**cfg.step_inputs(ordered, gstep, seed))
    return opt
