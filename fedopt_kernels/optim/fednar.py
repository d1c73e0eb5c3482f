"""FedNAR: co-clipping of gradient and weight decay (docs/algorithms.md)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional

import torch

from ..batched.mixin import ClientBatched
from ..core.ops import BATCHED, FEDNAR
from ..core.optimizer import FedOptimizer, check_number
from ..fl import algorithm
from ..fl.algorithm import Algorithm, Baseline, BenchCase, FlowerName, Variant
from ..fl.server_rules import RULES


class FedNAR(FedOptimizer):
    r"""Co-clipping of gradient and weight decay, annealed per round (FedNAR).

    From "FedNAR: Federated Optimization with Normalized Annealing Regularization" (Junbo Li, Ang Li,
    Chong Tian, Qirong Ho, Eric P. Xing, Hongyi Wang; NeurIPS 2023), Eq. 3-4 and Alg. 2. With ``t``
    the round index (``start_round(round_index=t)``; ``l_t`` is the round decay every optimizer of
    the package takes, here with the paper's default 0.998)::

        l_t  = lr * round_decay ** t
        d    = g + weight_decay * x + correction + prox_mu * (x - x0)
        s    = || d ||_2 over all parameters of the optimizer (all groups; squares summed in float64)
        coef = min(1, max_norm / (s + eps))          (torch clip_grad_norm_ semantics)
        x   -= l_t * coef * d

    i.e. the paper's ``lambda = l_t * coef`` and ``mu = l_t * weight_decay * coef``; the update
    norm never exceeds ``l_t * max_norm``. Run it on FedAvg (default), FedProx (``prox_mu``) or
    SCAFFOLD (``start_round(correction=...)``).
    """

    _spec = FEDNAR

    def __init__(
        self,
        params: Iterable,
        lr: float,
        weight_decay: float,
        max_norm: float = 10.0,
        round_decay: float = 0.998,
        eps: float = 1e-6,
        prox_mu: float = 0.0,
        backend: str = "auto",
        replay: Optional[bool] = None,
    ):
        defaults = dict(
            lr=lr, weight_decay=weight_decay, max_norm=max_norm, round_decay=round_decay, eps=eps, prox_mu=prox_mu
        )
        super().__init__(params, defaults, backend, replay)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("weight_decay", group["weight_decay"], low=0.0)
        check_number("max_norm", group["max_norm"], low=0.0, low_open=True)
        check_number("eps", group["eps"], low=0.0)


class BatchedFedNAR(ClientBatched, FedNAR):
    """FedNAR for ``C`` stacked clients: each client clips its own ``d`` by its own global norm
    (over all of that client's tensors), with ``l_t = lr * lr_scale[c] * round_decay ** t_c``."""

    _spec = BATCHED["fednar_batched"]


# ---------------------------------------------------------------------------- what a user writes instead
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


# ---------------------------------------------------------------------------- the descriptor
class _FedNAR(Algorithm):
    def hparams(self, cfg, variant):
        hp = super().hparams(cfg, variant)
        hp["clip_norm"] = 10.0 if cfg.clip_norm is None else cfg.clip_norm
        hp["round_decay"] = 0.998 if cfg.round_decay is None else cfg.round_decay
        return hp

    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(
            params,
            lr=hp["lr"],
            weight_decay=cfg.weight_decay,
            max_norm=hp["clip_norm"],
            round_decay=hp["round_decay"],
            prox_mu=hp["prox_mu"],
            backend=backend,
        )

    def lr_sum(self, opt, hp, t, steps):
        # K * lr * round_decay ** t; the clip coefficient is a device-side value and not included
        return steps * hp["lr"] * hp["round_decay"] ** t

    def state_copies(self, cfg, variant):
        return int(RULES[variant.server].keeps) + int(variant.prox)


DESCRIPTOR = algorithm.register(
    _FedNAR(
        "fednar",
        FedNAR,
        BatchedFedNAR,
        title="FedNAR: Federated Optimization with Normalized Annealing Regularization",
        settings=("weight_decay", "clip_norm", "round_decay"),
        refusals={"momentum": "its optimizer has none"},
        variants=(
            Variant("fednar", "avg"),
            Variant("fednar-fedprox", "avg", prox=True),
            Variant("fednar-scaffold", "scaffold"),
        ),
        flower=(
            FlowerName(
                "FedNARStrategy",
                {"fedavg": "fednar", "fedprox": "fednar-fedprox", "scaffold": "fednar-scaffold"},
                choose="backbone",
                aliases={"max_norm": "clip_norm"},
                doc="Co-clipping of gradient and weight decay on FedAvg, FedProx (prox_mu) or SCAFFOLD.",
            ),
        ),
        full="prox_correction",
        bench=(
            BenchCase(
                "fednar",
                "FedNAR wd max_norm=10",
                "wd",
                core=True,
                baselines=(Baseline("torch clip+SGD(fused)", ClipSGD),),
            ),
            BenchCase("fednar_scaffold_prox", "FedNAR + SCAFFOLD + FedProx", "prox_correction"),
        ),
        options={
            "unclipped": dict(lr=0.1, weight_decay=0.01, max_norm=1e6),
            "wd": dict(lr=0.1, weight_decay=5e-4, max_norm=10.0),
            "clipped": dict(lr=0.1, weight_decay=0.1, max_norm=0.5, round_decay=0.9),
            "prox_correction": dict(lr=0.1, weight_decay=0.05, max_norm=2.0, prox_mu=0.3, correction=True),
            "groups": dict(
                lr=0.1, weight_decay=0.01, max_norm=1.0, groups=dict(lr=0.5, max_norm=3.0, weight_decay=0.0)
            ),
        },
    )
)
