"""FedDyn's FL descriptor and its server: each client keeps ``g_i``, the server keeps ``h`` (FedDyn)."""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

from ...optim.feddyn import BatchedFedDyn, FedDyn
from .. import algorithm
from ..algorithm import Setting, Variant
from ..fold import sum_dtype
from ..server_rules import RULES, ServerRule, check_like, check_updates, register_rule
from .sgd import SGDAlgorithm

Tensors = List[torch.Tensor]


# ---------------------------------------------------------------------------- the server
@torch.no_grad()
def feddyn_server_step(
    x: Sequence[torch.Tensor],
    h: Sequence[torch.Tensor],
    deltas: Sequence[Sequence[torch.Tensor]],
    alpha: float,
    num_clients: int,
) -> Tuple[Tensors, Tensors]:
    """FedDyn's server step ("Federated Learning Based on Dynamic Regularization", Acar, Zhao,
    Matas, Mattina, Whatmough, Saligrama; ICLR 2021).

    ``delta_i = x_i - x`` is replying client i's model minus the global one, ``m = num_clients``
    the number of clients in the federation (not only this round's), ``h`` the server state (zeros
    at the start)::

        h'  = h - (alpha / m) * sum_i delta_i
        x'  = x + mean_i(delta_i) - h' / alpha         (unweighted mean over the replying clients)

    Returns ``(x', h')``; nothing is modified in place and clients are summed in the order given.
    """
    check_updates("deltas", deltas, x)
    check_like("h", h, x)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < len(deltas):
        raise ValueError(
            f"num_clients must be an integer >= the number of deltas ({len(deltas)}): it counts every "
            f"client of the federation, got {num_clients!r}"
        )
    out = RULES["feddyn"].step(
        list(x),
        {"h": list(h)},
        [list(d) for d in deltas],
        [1.0] * len(deltas),
        [{}] * len(deltas),
        {"dyn_alpha": alpha},
        num_clients,
        1,
    )
    return out["x"], out["h"]


class FedDynRule(ServerRule):
    """FedDyn's server: ``h`` kept by the server, ``g_i`` by each client (``feddyn_server_step``)."""

    name = "feddyn"
    state = ("h",)
    keeps = True

    def client_inputs(self, got, kept, x):
        return {"dyn_grad": kept if kept is not None else [torch.zeros_like(v) for v in x]}

    def client_finish(self, opt, algo, hp, t, steps, got, kept, delta):
        return opt.dyn_grad(), {}  # the round was ended (end_round) before the client finishes

    def add(self, fold, delta, weight, reply):
        fold.accumulate("delta", delta)  # an unweighted sum

    def finish(self, fold):
        """``feddyn_server_step``'s formulas on the fold's sum."""
        alpha, total = fold.hp["dyn_alpha"], fold.sums["delta"]
        h = [hj.clone().sub_(s, alpha=alpha / fold.num_clients) for hj, s in zip(fold.state["h"], total, strict=True)]
        x = [
            xj.clone().add_(s, alpha=1.0 / fold.count).sub_(hj, alpha=1.0 / alpha)
            for xj, s, hj in zip(fold.x, total, h, strict=True)
        ]
        return {"x": x, "h": h}

    def aggregate(self, fold, new_x):
        """``Δ`` for a server optimizer: the rule's new model minus the old, ``mean_i delta_i - h'/alpha``."""
        return [n.to(sum_dtype(n)) - o for n, o in zip(new_x, fold.x, strict=True)]


register_rule(FedDynRule())


# ---------------------------------------------------------------------------- the client side
class _FedDyn(SGDAlgorithm):
    def hparams(self, cfg, variant):
        return {**super().hparams(cfg, variant), "dyn_alpha": 0.01 if cfg.dyn_alpha is None else cfg.dyn_alpha}

    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(
            params,
            lr=hp["lr"],
            alpha=hp["dyn_alpha"],
            beta=hp["beta"],
            schedule=cfg.decay_schedule,
            decay_every=cfg.decay_every,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            round_decay=hp["round_decay"],
            backend=backend,
        )

    def state_copies(self, cfg, variant):
        return int(cfg.momentum != 0) + 3  # momentum, x0, -g_i and the g_i the run keeps for the client

    def present(self, kwargs, correction, scales):
        return (("momentum_buffer",) if kwargs.get("momentum", 0) else ()) + ("x0", "correction")


DESCRIPTOR = algorithm.register(
    _FedDyn(
        "feddyn",
        FedDyn,
        BatchedFedDyn,
        title="Federated Learning Based on Dynamic Regularization",
        settings=("beta", "momentum", "weight_decay", "clip_norm", "round_decay"),
        run_settings=(
            Setting(
                "dyn_alpha", float, None, "FedDyn's regularisation coefficient alpha (default 0.01)", low_open=True
            ),
        ),
        variants=(Variant("feddyn", "feddyn"),),
        round_outputs=("dyn_grad",),
        full="momentum",
        # every option set uses the x0 and correction roles (alpha * (x - x0) and -g_i)
        options={
            "plain": dict(lr=0.1, alpha=0.1),
            "momentum": dict(lr=0.05, alpha=0.3, momentum=0.9, dampening=0.1),
            "nesterov_wd": dict(lr=0.05, alpha=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
            "decay_wd": dict(lr=0.1, alpha=0.5, beta=0.7, weight_decay=0.01),
            "linear_every2": dict(lr=0.1, alpha=0.2, beta=0.4, schedule="linear", decay_every=2, momentum=0.3),
            "groups": dict(lr=0.1, alpha=0.1, momentum=0.9, groups=dict(lr=0.03, alpha=0.5)),
        },
    )
)
