"""FedSAM's FL descriptor: sharpness-aware local steps on FedAvg or SCAFFOLD, and ASAM's adaptive form.
A step takes two gradients, so ``local_step`` hands the step a closure that computes the second one."""

from __future__ import annotations

from ...optim.fedsam import BatchedFedSAM, FedSAM
from .. import algorithm
from ..algorithm import Setting, Variant
from .sgd import SGDAlgorithm


class _FedSAM(SGDAlgorithm):
    closure_step = True  # two gradients per step: step(closure)

    def hparams(self, cfg, variant):
        return {
            **super().hparams(cfg, variant),
            "sam_rho": 0.05 if cfg.sam_rho is None else cfg.sam_rho,
            "sam_eta": 0.01 if cfg.sam_eta is None else cfg.sam_eta,
        }

    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(
            params,
            lr=hp["lr"],
            rho=hp["sam_rho"],
            eta=hp["sam_eta"],
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            prox_mu=hp["prox_mu"],
            round_decay=hp["round_decay"],
            backend=backend,
            **variant.options,
        )

    def lr_sum(self, opt, hp, t, steps):
        # the descent's lr of round t, lr * round_decay ** t, K times (SCAFFOLD option II)
        return steps * (opt.param_groups[0]["lr"] * hp["round_decay"] ** t)

    def state_copies(self, cfg, variant):
        return super().state_copies(cfg, variant) + 1  # the saved x


DESCRIPTOR = algorithm.register(
    _FedSAM(
        "fedsam",
        FedSAM,
        BatchedFedSAM,
        title="Improving Generalization in Federated Learning by Seeking Flat Minima",
        settings=("momentum", "weight_decay", "round_decay"),
        run_settings=(
            Setting("sam_rho", float, None, "FedSAM's ascent radius rho (default 0.05)"),
            Setting("sam_eta", float, None, "FedASAM's eta in w = |x| + eta (default 0.01)"),
        ),
        refusals={"clip_norm": "its ascent is normalized; clip before step(closure) yourself if you must"},
        variants=(
            Variant("fedsam", "avg"),
            Variant("fedasam", "avg", options={"adaptive": True}),
            Variant("fedsam-scaffold", "scaffold"),
        ),
        full="prox_correction",
        options={
            "plain": dict(lr=0.1, rho=0.05),
            "rho0": dict(lr=0.1, rho=0.0, momentum=0.9),
            "adaptive": dict(lr=0.05, rho=0.5, adaptive=True, eta=0.01, weight_decay=0.01),
            "momentum_wd": dict(lr=0.05, rho=0.05, momentum=0.9, weight_decay=5e-4),
            "nesterov": dict(lr=0.05, rho=0.1, momentum=0.9, nesterov=True, dampening=0.0),
            "prox_correction": dict(lr=0.1, rho=0.2, prox_mu=0.3, correction=True, momentum=0.5, dampening=0.1),
            "groups": dict(lr=0.1, rho=0.05, momentum=0.9, groups=dict(lr=0.03, rho=0.3, adaptive=True)),
        },
    )
)
