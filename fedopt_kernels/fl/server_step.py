"""A round's server step: the run's server optimizer on the round's aggregate (docs/algorithms.md,
"Server optimizers").

The server treats the aggregate ``Δ`` of a round (``ServerRule.aggregate``: for FedAvg's rule
``sum_i w_i Δ_i / sum_i w_i``) as the negative of a gradient, ``g = -Δ``, and steps a
``torch.optim`` optimizer with it on the global model ("Adaptive Federated Optimization", Reddi,
Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan; ICLR 2021, Algorithm 2):

* ``sgd``: ``x += server_lr * Δ``, the rule's own finish, arithmetic unchanged (no optimizer);
* ``avgm``: FedAvgM, ``adam``: FedAdam, ``yogi``: FedYogi, ``adagrad``: FedAdagrad, ``exp``:
  FedExP, whose step size reads the weighted mean of the clients' ``||Δ_i||^2`` (the fold sums it,
  ``Fold.keep_sq_norms``).

Here: the names, which settings each one takes and their defaults (read by ``FLConfig.validate``),
and ``ServerStep``, which steps an optimizer built by a front end (``sim/server_optimizer.py``)
on a finished fold. A rule whose server step is its own (PAdaMFed's) refuses every optimizer but
``sgd``. What the rule keeps besides the model (SCAFFOLD's ``c``, FedDyn's ``h``) is the rule's:
the optimizer steps the model only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .fold import Fold
from .server_rules import RULES

Tensors = List[torch.Tensor]

NAMES = ("sgd", "avgm", "adam", "yogi", "adagrad", "exp")
_ADAPTIVE = ("server_lr", "server_beta1", "server_tau", "server_initial_accumulator", "server_bias_correction")
# the run settings each server optimizer takes; another one set away from its default is refused
TAKES: Mapping[str, Sequence[str]] = {
    "sgd": ("server_lr",),
    "avgm": ("server_lr", "server_momentum", "server_nesterov"),
    "adam": _ADAPTIVE + ("server_beta2",),
    "yogi": _ADAPTIVE + ("server_beta2",),
    "adagrad": _ADAPTIVE,
    "exp": ("server_eps",),
}
SETTINGS = tuple(dict.fromkeys(s for names in TAKES.values() for s in names))
# the defaults of the settings left None (server_lr's for sgd is the algorithm's: 1, PAdaMFed's gamma)
DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "avgm": {"server_lr": 1.0, "server_momentum": 0.9},
    "adam": {"server_lr": 1e-2, "server_beta1": 0.9, "server_beta2": 0.99, "server_tau": 1e-3},
    "yogi": {"server_lr": 1e-2, "server_beta1": 0.9, "server_beta2": 0.99, "server_tau": 1e-3},
    "adagrad": {"server_lr": 1e-2, "server_beta1": 0.9, "server_tau": 1e-3},
    "exp": {"server_eps": 1e-3},
}


# for the docs' table of algorithms (``algorithm.index_markdown``): class, what it does, paper
INDEX: Mapping[str, Tuple[str, str, str]] = {
    "avgm": (
        "FedAvgM",
        "Server optimizer: SGD with momentum on the round's aggregate (FedAvgM)",
        "Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification",
    ),
    "adam": ("FedAdam", "Server optimizer: Adam on the round's aggregate (FedAdam)", "Adaptive Federated Optimization"),
    "yogi": ("FedYogi", "Server optimizer: Yogi on the round's aggregate (FedYogi)", "Adaptive Federated Optimization"),
    "adagrad": (
        "FedAdagrad",
        "Server optimizer: Adagrad with momentum on the round's aggregate (FedAdagrad)",
        "Adaptive Federated Optimization",
    ),
    "exp": (
        "FedExP",
        "Server optimizer: an extrapolated step, sized each round from the clients' updates (FedExP)",
        "FedExP: Speeding Up Federated Averaging via Extrapolation",
    ),
}


def setting(cfg: Any, name: str) -> Any:
    """Run setting ``name`` of ``cfg``, its server optimizer's default where it is None."""
    value = getattr(cfg, name)
    return DEFAULTS.get(cfg.server_optimizer, {}).get(name) if value is None else value


def check(cfg: Any) -> None:
    """ValueError naming the setting: a server setting the run's server optimizer does not take, or a
    server optimizer on a rule whose server step is its own."""
    name = cfg.server_optimizer
    if name not in NAMES:
        raise ValueError(f"server_optimizer must be one of {NAMES}, got {name!r}")
    rule = RULES[cfg.server_rule]
    if name != "sgd" and not rule.takes_server_optimizer:
        raise ValueError(
            f"server_optimizer={name!r} does not apply to algorithm={cfg.algorithm!r}: its server step is its "
            f"own ({rule.name!r} rule): use server_optimizer='sgd'"
        )
    fields = type(cfg).__dataclass_fields__
    for key in SETTINGS:
        if key not in TAKES[name] and getattr(cfg, key) != fields[key].default:
            takers = [n for n in NAMES if key in TAKES[n]]
            raise ValueError(
                f"{key} does not apply to server_optimizer={name!r} (it applies to {', '.join(takers)})"
                + (": FedExP computes its server step size each round" if key == "server_lr" else "")
            )


def optimizer_options(cfg: Any) -> Dict[str, Any]:
    """The constructor keywords of the run's server optimizer (none for ``sgd``)."""
    name = cfg.server_optimizer
    lr, b1, tau = setting(cfg, "server_lr"), setting(cfg, "server_beta1"), setting(cfg, "server_tau")
    adaptive = {
        "lr": lr,
        "tau": tau,
        "initial_accumulator_value": cfg.server_initial_accumulator,
        "bias_correction": cfg.server_bias_correction,
    }
    if name == "avgm":
        return {"lr": lr, "momentum": setting(cfg, "server_momentum"), "nesterov": cfg.server_nesterov}
    if name in ("adam", "yogi"):
        return {**adaptive, "betas": (b1, setting(cfg, "server_beta2"))}
    if name == "adagrad":
        return {**adaptive, "beta1": b1}
    if name == "exp":
        return {"eps": setting(cfg, "server_eps")}
    return {}


class ServerStep:
    """The server's step on a finished fold: the rule's new model (``sgd``: ``optimizer`` None), or
    ``optimizer`` (over the global model's tensors ``x``, one per run) stepped with ``p.grad = -Δ``.

    ``norms``: the optimizer's ``step`` takes ``mean_sq_norm``, the weighted mean of the clients'
    ``||Δ_i||^2`` (FedExP), which the fold then sums (``begin``)."""

    def __init__(self, name: str, optimizer: Optional[torch.optim.Optimizer] = None, norms: bool = False):
        self.name, self.optimizer, self.norms = name, optimizer, norms
        self.x: Tensors = [] if optimizer is None else [p for g in optimizer.param_groups for p in g["params"]]

    def begin(self, fold: Fold) -> Fold:
        """``fold``, summing the clients' squared update norms where the step reads them."""
        if self.norms:
            fold.keep_sq_norms()
        return fold

    @torch.no_grad()
    def step(self, fold: Fold, new_x: Tensors) -> Tensors:
        """The round's new model from a finished ``fold`` and the rule's new model ``new_x``: ``new_x``
        itself (``sgd``), else the optimizer's tensors, set to the round's starting model and stepped
        on ``g = -fold.rule.aggregate(fold, new_x)``."""
        if self.optimizer is None:
            return new_x
        delta = fold.rule.aggregate(fold, new_x)
        for p, x0, d in zip(self.x, fold.x, delta, strict=True):
            if p is not x0:  # a front end whose model is not the optimizer's tensors (Flower's)
                p.copy_(x0)
            p.grad = d.neg().to(p.dtype)  # one rounding of the float64 aggregate
        if self.norms:
            step: Any = self.optimizer.step  # FedExP's step(*, mean_sq_norm)
            step(mean_sq_norm=fold.sums["sq_norm"][0] / fold.weight)  # both scaled by 2**-exponent
        else:
            self.optimizer.step()
        for p in self.x:
            p.grad = None
        return self.x

    # ------------------------------------------------------------------ state (checkpoints, ranks)
    def tensors(self) -> Tensors:
        """The optimizer's state tensors (each parameter's, by key), in a fixed order; none for ``sgd``."""
        if self.optimizer is None:
            return []
        out: Tensors = []
        for p in self.x:
            st = self.optimizer.state.get(p, {})
            out += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
        return out

    def load_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` (another run's ``tensors()`` after as many rounds) into this state."""
        mine = self.tensors()
        if len(mine) != len(tensors) or any(a.shape != b.shape for a, b in zip(mine, tensors, strict=False)):
            raise ValueError(
                f"the server optimizer's state has {len(mine)} tensors, the given one {len(tensors)}: "
                f"not the state of the same server optimizer after as many rounds"
            )
        for a, b in zip(mine, tensors, strict=True):
            a.copy_(b)

    def state_dict(self) -> Dict[str, Any]:
        return {} if self.optimizer is None else self.optimizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.optimizer is None:
            if state:
                raise ValueError("a server optimizer's state was given to a run whose server optimizer is 'sgd'")
            return
        if not state:
            raise ValueError(f"no state was given for the server optimizer {self.name!r}")
        self.optimizer.load_state_dict(dict(state))
