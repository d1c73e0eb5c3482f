"""FedNova's server rule: every client's update normalized by its local work, then scaled back.

"Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization" (Wang, Liu,
Liang, Joshi, Poor; NeurIPS 2020). A client that takes more local steps moves further; FedAvg's
weighted mean then pulls the model toward the objective of the clients that worked most. FedNova
divides each update ``Delta_i`` by ``a_i``, the sum of the weights its local steps gave their
gradients (in units of the lr), and steps the server by the weighted mean of the normalized
updates times ``tau_eff``, the weighted mean of the ``a_i``::

    p_i = w_i / sum_j w_j                       (w_i: the client's number of training samples)
    tau_eff = sum_i p_i a_i
    x <- x + server_lr * tau_eff * sum_i p_i Delta_i / a_i

``a_i`` (``normalizer``) of a client that took ``tau_i`` steps with lr ``eta``:

* plain SGD: ``tau_i``;
* local momentum rho (torch's heavy ball): ``sum_{k=1}^{tau_i} (1 - rho^k) / (1 - rho)``;
* a proximal term mu (FedProx): ``sum_{k=0}^{tau_i - 1} (1 - eta mu)^k``;
* both, dampening, Nesterov: the same sum for the combined recursion (the update the round
  would make if every gradient were 1, divided by ``-eta``);
* other client optimizers (FedNAR's normalized steps, FedSAM's ascent, FedNLR's neuron scales):
  ``tau_i`` with their momentum and proximal term as above: their per-coordinate factors are not
  a sum of step weights; weight decay is counted as part of the gradient.

With equal ``a_i`` this is FedAvg's rule (to float32 rounding). The fold (``fold.py``) keeps
``sum_i w_i Delta_i / a_i`` and ``sum_i w_i a_i`` in float64, streamed, and several ranks' folds
merge in rank order like any other rule's.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

import torch

from .fold import Fold, sum_dtype
from .server_rules import ServerRule, Tensors, register_rule

__all__ = ["FedNovaRule", "normalizer"]


def normalizer(
    steps: int,
    lr: float = 1.0,
    momentum: float = 0.0,
    prox_mu: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
) -> float:
    """``a_i``: the sum of the weights ``steps`` local steps give their gradients, in units of ``lr``
    (module docstring). Computed by running the step's recursion on scalars with every gradient 1:
    with ``y`` the distance moved, ``b`` the momentum buffer, ``d = 1 + prox_mu * y`` the step's
    gradient, ``b <- momentum * b + (1 - dampening) * d`` (``b = d`` at the first step, as torch's
    SGD), ``y <- y - lr * (d + momentum * b if nesterov else b)``; then ``a = -y / lr``."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0 for FedNova's normalizer, got {lr}")
    if momentum == 0.0 and prox_mu == 0.0:
        return float(steps)
    y, b = 0.0, 0.0
    for k in range(steps):
        d = 1.0 + prox_mu * y
        b = d if k == 0 else momentum * b + (1.0 - dampening) * d
        y -= lr * (d + momentum * b if nesterov else b) if momentum else lr * d
    return -y / lr


class FedNovaRule(ServerRule):
    """FedNova's server (module docstring): each client replies ``a_i`` (``"nova_a"``) beside its update."""

    name = "nova"
    scalars = ("nova_a",)

    def client_finish(self, opt, algo, hp, t, steps, got, kept, delta):
        group = opt.param_groups[0]
        a = normalizer(
            steps,
            lr=float(group["lr"]) * float(group.get("round_decay", 1.0)) ** t,  # the round's lr
            momentum=float(group.get("momentum", 0.0) or 0.0),
            prox_mu=float(hp.get("prox_mu", 0.0) or 0.0),
            dampening=float(group.get("dampening", 0.0) or 0.0),
            nesterov=bool(group.get("nesterov", False)),
        )
        return None, {"nova_a": a}

    def begin(
        self,
        x: Tensors,
        state: Mapping[str, Tensors],
        hp: Mapping[str, Any],
        num_clients: int,
        local_steps: int,
        exponent: int = 0,
    ) -> Fold:
        fold = super().begin(x, state, hp, num_clients, local_steps, exponent)
        # sum_i w_i a_i: one number, kept as a tensor so that ranks merge it with the other sums
        fold.sums["nova_a"] = [torch.zeros((), dtype=sum_dtype(x[0]), device=x[0].device)]
        return fold

    def add(self, fold: Fold, delta: Sequence[torch.Tensor], weight: float, reply: Mapping[str, Any]) -> None:
        a = float(reply["nova_a"])
        if not a > 0:
            raise ValueError(f"FedNova's normalizer a_i must be > 0, got {a}")
        w = fold.scaled(weight)
        fold.accumulate("delta", delta, w / a)
        fold.sums["nova_a"][0].add_(w * a)

    def finish(self, fold: Fold) -> Dict[str, Tensors]:
        # x + server_lr * (sum_i w_i a_i / W) * (sum_i w_i delta_i / a_i) / W, W = sum_i w_i (scaled alike)
        coef = fold.sums["nova_a"][0] * (fold.hp["server_lr"] / (fold.weight * fold.weight))
        return {"x": [xj.clone().add_(s * coef) for xj, s in zip(fold.x, fold.sums["delta"], strict=True)]}

    def aggregate(self, fold: Fold, new_x: Tensors) -> Tensors:
        """``Δ`` for a server optimizer: ``tau_eff * sum_i p_i delta_i / a_i``, FedNova's step without
        ``server_lr`` (the server optimizer's own lr scales it)."""
        coef = fold.sums["nova_a"][0] / (fold.weight * fold.weight)
        return [s * coef for s in fold.sums["delta"]]


register_rule(FedNovaRule())
