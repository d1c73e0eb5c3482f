"""FedNAR's FL descriptor: co-clipping on FedAvg, FedProx or SCAFFOLD."""

from __future__ import annotations

from ...optim.fednar import BatchedFedNAR, FedNAR
from .. import algorithm
from ..algorithm import Algorithm, Variant
from ..server_rules import RULES


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
        full="prox_correction",
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
