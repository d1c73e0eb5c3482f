"""NeuronLRSGD's FL descriptor: FedNLR, whose clients recalibrate their neuron scales every round."""

from __future__ import annotations

from ...optim.neuron_lr import BatchedNeuronLRSGD, NeuronLRSGD, neuron_lr_scales
from .. import algorithm
from ..algorithm import Setting, Variant
from .sgd import SGDAlgorithm


class _FedNLR(SGDAlgorithm):
    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(
            params,
            lr=hp["lr"],
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            round_decay=hp["round_decay"],
            backend=backend,
        )

    def calibrate(self, model, data, cfg):
        if data is None:
            raise ValueError("FedNLR needs calibration=(inputs, targets): the data its neuron scales are computed on")
        # FedNLR's scales from the received model's activations on the client's data (FedNLR paper, Alg. 1)
        return {"neuron_scales": neuron_lr_scales(model, data, mu0=cfg.nlr_mu0, c1=cfg.nlr_c1, c2=cfg.nlr_c2)}

    def state_copies(self, cfg, variant):
        return super().state_copies(cfg, variant) + 1  # the scales (per row; counted as a copy, an upper bound)


DESCRIPTOR = algorithm.register(
    _FedNLR(
        "neuron_lr",
        NeuronLRSGD,
        BatchedNeuronLRSGD,
        title="FedNLR: Federated Learning with Neuron-wise Learning Rates",
        settings=("momentum", "weight_decay", "clip_norm", "round_decay"),
        # the scale-range constants of neuron_lr_scales: mu_l = mu0 + c1 * l / L + c2 * log10(M_l)
        run_settings=(
            Setting("nlr_mu0", float, 1.0, "FedNLR's mu0 in mu_l = mu0 + c1 l/L + c2 log10 M_l (default %(default)s)"),
            Setting("nlr_c1", float, 1.0, "FedNLR's c1 (default %(default)s)"),
            Setting("nlr_c2", float, 1.0, "FedNLR's c2 (default %(default)s)"),
        ),
        variants=(Variant("fednlr", "avg"),),
        full="scales_all",
        options={
            "scales": dict(lr=0.1, scales=True),
            "scales_momentum": dict(lr=0.05, momentum=0.9, nesterov=True, scales=True),
            "scales_all": dict(lr=0.05, momentum=0.5, weight_decay=0.01, prox_mu=0.2, correction=True, scales=True),
            "groups": dict(lr=0.1, scales=True, groups=dict(lr=0.01, momentum=0.9)),
            "every_row": dict(lr=0.05, momentum=0.9, weight_decay=5e-4, scales="every"),
        },
    )
)
