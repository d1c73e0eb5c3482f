"""Client optimizers: which package optimizer each algorithm trains with, and how a round starts on it.

Each client keeps ONE optimizer for the whole simulation (``ClientOptimizers``): the package's
optimizers count rounds through ``start_round`` and FedNAR anneals its lr by that count, so a client
that sat out some rounds is first advanced to the global round index (``advance_to_round``). All
client optimizers act on the same model object, whose parameters the simulation overwrites with the
global model before each client trains.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch
from torch import nn

from .. import FedDecaySGD, FedNAR, NeuronLRSGD, PAdaMFed, neuron_lr_scales
from .clients import ClientData
from .config import SimConfig

Optimizer = torch.optim.Optimizer


def advance_to_round(opt: Any, t: int, **round_inputs: Any) -> None:
    """Call ``start_round`` so that the round it starts has index ``t`` (the global round)."""
    if opt.round_index >= t:
        raise RuntimeError(f"client optimizer is already at round {opt.round_index}, cannot start round {t}")
    while opt.round_index < t - 1:  # rounds this client sat out
        opt.start_round()
    opt.start_round(**round_inputs)


class ClientOptimizers:
    """Builds each client's optimizer on first use and starts its rounds.

    ``kind``: "decay" (FedDecaySGD: FedAvg, FedSGD, FedDecay, FedProx, SCAFFOLD), "nlr" (NeuronLRSGD,
    scales recalibrated every round), "nar" (FedNAR) or "padamfed".
    """

    def __init__(self, cfg: SimConfig, hp: Dict[str, Any], model: nn.Module, backend: str):
        self.cfg, self.hp, self.model, self.backend = cfg, hp, model, backend
        self.kind = cfg.client_optimizer
        self._opts: Dict[int, Optimizer] = {}

    def get(self, cid: int) -> Optimizer:
        opt = self._opts.get(cid)
        if opt is None:
            opt = self._opts[cid] = self._build()
        return opt

    def _build(self) -> Optimizer:
        return self.build_on(list(self.model.parameters()))

    def build_on(self, params: List[torch.Tensor], form: Callable[[type], type] = lambda cls: cls) -> Optimizer:
        """This run's client optimizer on ``params``; ``form`` maps the class (e.g. to its client-batched form)."""
        cfg, hp = self.cfg, self.hp
        if self.kind == "decay":
            return form(FedDecaySGD)(params, lr=hp["lr"], beta=hp["beta"], schedule=cfg.decay_schedule,
                                     decay_every=cfg.decay_every, momentum=cfg.momentum,
                                     weight_decay=cfg.weight_decay, prox_mu=hp["prox_mu"], backend=self.backend)
        if self.kind == "nlr":
            return form(NeuronLRSGD)(params, lr=hp["lr"], momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                     backend=self.backend)
        if self.kind == "nar":
            return form(FedNAR)(params, lr=hp["lr"], weight_decay=cfg.weight_decay, max_norm=hp["clip_norm"],
                                round_decay=hp["round_decay"], prox_mu=hp["prox_mu"], backend=self.backend)
        if self.kind == "padamfed":
            return form(PAdaMFed)(params, lr=hp["lr"], beta=hp["beta"],
                                  variance_reduction=cfg.algorithm.endswith("-vr"), backend=self.backend)
        raise ValueError(f"unknown client optimizer kind {self.kind!r}")

    def round_lr(self, t: int) -> float:
        """The SGD optimizers' lr in round ``t`` (FedNAR anneals by itself, PAdaMFed keeps eta)."""
        return self.hp["lr"] * self.hp["round_decay"] ** t

    def begin(self, cid: int, client: ClientData, t: int, **round_inputs: Any) -> Optimizer:
        """Start round ``t`` on client ``cid``'s optimizer (the model already holds the global weights)."""
        opt = self.get(cid)
        if self.kind in ("decay", "nlr"):
            # FedNAR anneals by itself; the SGD optimizers get the same per-round decay through their lr
            for group in opt.param_groups:
                group["lr"] = self.round_lr(t)
        if self.kind == "nlr":
            # FedNLR: scales from the received model's activations on this client's data (FedNLR paper, Alg. 1)
            round_inputs["neuron_scales"] = neuron_lr_scales(
                self.model, [(client.train_x, client.train_y)],
                mu0=self.cfg.nlr_mu0, c1=self.cfg.nlr_c1, c2=self.cfg.nlr_c2)
        advance_to_round(opt, t, **round_inputs)
        return opt

    def clip(self) -> None:
        """Gradient clipping of the SGD baselines (FedNAR clips inside its step, PAdaMFed normalizes)."""
        if self.kind in ("decay", "nlr") and self.hp["clip_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hp["clip_norm"])

    def lr_sum(self, opt: Optimizer, t: int, steps: int) -> float:
        """Sum of the nominal per-step learning rates of the round just trained (SCAFFOLD option II).

        FedDecaySGD: ``lr_t * sum_k s(k // decay_every)``, exact under within-round decay. FedNAR:
        ``K * lr * round_decay ** t``; its clip coefficient is a device-side value and not included.
        """
        if self.kind == "decay":
            return opt.param_groups[0]["lr"] * sum(opt.schedule.factor(k) for k in range(steps))
        if self.kind == "nar":
            return steps * self.hp["lr"] * self.hp["round_decay"] ** t
        raise ValueError(f"SCAFFOLD is not defined for client optimizer {self.kind!r}")
