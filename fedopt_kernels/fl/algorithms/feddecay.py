"""FedDecaySGD's FL descriptor: FedAvg, FedSGD, FedDecay, FedProx and SCAFFOLD on its SGD steps."""

from __future__ import annotations

from ...optim.feddecay import BatchedFedDecaySGD, FedDecaySGD
from .. import algorithm
from .. import fednova as _fednova  # noqa: F401  (registers FedNova's server rule)
from ..algorithm import Variant
from .sgd import SGDAlgorithm


class _FedDecay(SGDAlgorithm):
    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(
            params,
            lr=hp["lr"],
            beta=hp["beta"],
            schedule=cfg.decay_schedule,
            decay_every=cfg.decay_every,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            prox_mu=hp["prox_mu"],
            round_decay=hp["round_decay"],
            backend=backend,
        )

    def lr_sum(self, opt, hp, t, steps):
        # exact under within-round decay: lr_t * sum_k s(k // decay_every), lr_t = lr * round_decay ** t
        lr_t = opt.param_groups[0]["lr"] * hp["round_decay"] ** t
        return lr_t * sum(opt.schedule.factor(k) for k in range(steps))


DESCRIPTOR = algorithm.register(
    _FedDecay(
        "feddecay",
        FedDecaySGD,
        BatchedFedDecaySGD,
        title="FedDecay: Adapting to Data Heterogeneity in Federated Learning with Gradient Decay",
        settings=("beta", "momentum", "weight_decay", "clip_norm", "round_decay"),
        # fedsgd is FedDecay with beta = 0: only the first of the local steps moves (the others have lr 0)
        variants=(
            Variant("fedavg", "avg", beta=1.0),
            Variant("fedsgd", "avg", beta=0.0),
            Variant("feddecay", "avg", defaults={"beta": 0.5}),
            Variant("fedprox", "avg", prox=True),
            Variant("scaffold", "scaffold"),
            # FedNova's server (fl/fednova.py) on FedAvg's and FedProx's clients
            Variant("fednova", "nova", beta=1.0),
            Variant("fednova-fedprox", "nova", prox=True, beta=1.0),
        ),
        full="prox_correction",
        options={
            "plain": dict(lr=0.1, beta=0.5),
            "momentum": dict(lr=0.05, beta=0.8, momentum=0.9, dampening=0.1),
            "nesterov": dict(lr=0.05, beta=0.7, momentum=0.9, nesterov=True, weight_decay=0.01),
            "wd_maximize": dict(lr=0.1, beta=0.9, weight_decay=0.05, maximize=True),
            "prox_correction": dict(lr=0.1, beta=0.6, prox_mu=0.5, correction=True, momentum=0.5),
            "linear_every2": dict(lr=0.1, beta=0.4, schedule="linear", decay_every=2, momentum=0.3),
            "fedsgd_beta0": dict(lr=0.1, beta=0.0),
            "momentum_wd": dict(lr=0.05, beta=0.9, momentum=0.9, weight_decay=5e-4),
            "groups": dict(lr=0.1, beta=0.5, momentum=0.9, groups=dict(lr=0.03, weight_decay=0.1)),
        },
    )
)
