"""PAdaMFed's FL descriptor and its server: global control ``c`` and momentum ``m``, each client's
``c_i``, and an initial round of controls (PAdaMFed)."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ...optim.padamfed import BatchedPAdaMFed, PAdaMFed, theory_hparams
from .. import algorithm
from ..algorithm import Algorithm, Variant
from ..server_rules import RULES, ServerRule, Tensors, check_like, check_updates, register_rule


# ---------------------------------------------------------------------------- the server
@torch.no_grad()
def padamfed_init(local_controls: Sequence[Sequence[torch.Tensor]], num_clients: int) -> Tuple[Tensors, Tensors]:
    """PAdaMFed's initial server state from the clients' first controls: ``c = sum_i ci / N``, ``m = c``.

    Each ``ci`` is the mean of K stochastic gradients at the initial model ("Problem-Parameter-Free
    Federated Learning", Yan, Zhang, Wang, Cao: Alg. 1, line 1). A client missing from
    ``local_controls`` counts as ``ci = 0``.
    """
    if len(local_controls) == 0:
        raise ValueError("local_controls is empty: PAdaMFed's initialisation needs at least one client")
    check_updates("local_controls", local_controls, local_controls[0])
    state = RULES["padamfed"].initial_state([list(ci) for ci in local_controls], num_clients)
    return state["c"], state["m"]


@torch.no_grad()
def padamfed_step(
    x: Sequence[torch.Tensor],
    c: Sequence[torch.Tensor],
    m: Sequence[torch.Tensor],
    deltas: Sequence[Sequence[torch.Tensor]],
    dcs: Sequence[Sequence[torch.Tensor]],
    num_clients: int,
    lr: float,
    local_steps: int,
    server_lr: float,
    beta: float,
) -> Tuple[Tensors, Tensors, Tensors]:
    """PAdaMFed's server step ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao: Alg. 1).

    With S = len(deltas) clients, eta = ``lr``, K = ``local_steps``, gamma = ``server_lr``::

        x'  = x + gamma * mean_i(delta_i) / (eta * K)     (delta_i = y_i - x; the paper's
                                                       x - gamma * mean(x - y_i) / (eta K))
        dc  = sum_i (ci' - ci)
        m'  = beta * (dc / S + c) + (1 - beta) * m
        c'  = c + dc / N

    Returns ``(x', c', m')``. ``eta = 0`` leaves x unchanged (no client moved).
    """
    check_updates("deltas", deltas, x)
    check_updates("dcs", dcs, x)
    if len(dcs) != len(deltas):
        raise ValueError(f"dcs has {len(dcs)} entries for {len(deltas)} deltas")
    check_like("c", c, x)
    check_like("m", m, x)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    hp = {"lr": lr, "server_lr": server_lr, "beta": beta}
    replies = [{"dc": list(dc)} for dc in dcs]
    state = {"c": list(c), "m": list(m)}
    out = RULES["padamfed"].step(
        list(x), state, [list(d) for d in deltas], [1.0] * len(deltas), replies, hp, num_clients, local_steps
    )
    return out["x"], out["c"], out["m"]


class PAdaMFedRule(ServerRule):
    """PAdaMFed's server ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao; Alg. 1):
    global momentum ``m`` and control ``c`` (``padamfed_step``); every client keeps its
    ``c_i`` and computes the first one before round 1 (``padamfed_init``)."""

    name = "padamfed"
    uneven = False  # its server step divides by the one K of every client
    state = ("c", "m")
    sent = {"control": "c", "momentum": "m"}
    keeps = True
    reply = ("dc",)
    init_controls = True
    takes_server_optimizer = False  # its x, m and c step is its own

    def initial_finish(self, fold):
        """``c = sum_i ci / N`` from the clients' first controls (the mean of K gradients at the
        initial model), ``m = c``."""
        return {"c": fold.total, "m": [cj.clone() for cj in fold.total]}

    def client_inputs(self, got, kept, x):
        return {"global_control": got["c"], "local_control": kept, "momentum": got["m"]}

    def client_finish(self, opt, algo, hp, t, steps, got, kept, delta):
        new_ci = [v.to(d.dtype) for v, d in zip(opt.local_control(), delta, strict=True)]
        ci = kept if kept is not None else [torch.zeros_like(d) for d in delta]
        return new_ci, {"dc": [n - o for n, o in zip(new_ci, ci, strict=True)]}

    sums = ("delta", "dc")

    def add(self, fold, delta, weight, reply):
        fold.accumulate("delta", delta)  # unweighted: the paper's mean over the S clients
        fold.accumulate("dc", reply["dc"])

    def finish(self, fold):
        """``padamfed_step``'s formulas on the fold's sums."""
        hp, S = fold.hp, fold.count
        c, m = fold.state["c"], fold.state["m"]
        scale = hp["server_lr"] / (hp["lr"] * fold.local_steps) if hp["lr"] > 0 else 0.0
        beta, total, dc = hp["beta"], fold.sums["delta"], fold.sums["dc"]
        return {
            "x": [xj.clone().add_(d, alpha=scale / S) for xj, d in zip(fold.x, total, strict=True)],
            # m uses the old c
            "m": [mj.clone().mul_(1 - beta).add_(d / S + cj, alpha=beta) for mj, d, cj in zip(m, dc, c, strict=True)],
            "c": [cj.clone().add_(d, alpha=1.0 / fold.num_clients) for cj, d in zip(c, dc, strict=True)],
        }


register_rule(PAdaMFedRule())


# ---------------------------------------------------------------------------- the client side
class _PAdaMFed(Algorithm):
    def hparams(self, cfg, variant):
        eta, gamma, beta = theory_hparams(
            cfg.sampled_per_round,
            cfg.local_steps,
            cfg.rounds,
            variance_reduction=variant.options.get("variance_reduction", False),
        )
        return {
            "lr": (eta if cfg.lr is None else cfg.lr) * cfg.lr_scale,
            "server_lr": gamma if cfg.server_lr is None else cfg.server_lr,
            "beta": beta if cfg.beta is None else cfg.beta,
            "prox_mu": 0.0,
            "clip_norm": None,
            "round_decay": 1.0,
        }

    def make(self, params, cfg, variant, hp, backend, batched=False):
        cls = self.batched if batched else self.optimizer
        return cls(
            params, lr=hp["lr"], beta=hp["beta"], round_decay=hp["round_decay"], backend=backend, **variant.options
        )

    def state_copies(self, cfg, variant):
        # D, acc, the given local control (+ anchor gradients)
        return 3 + int(bool(variant.options.get("variance_reduction")))

    def needs_anchor(self, variant):
        return bool(variant.options.get("variance_reduction"))

    def step_inputs(self, kwargs, params, seed):
        if not kwargs.get("variance_reduction"):
            return {}
        g = torch.Generator().manual_seed(seed)
        return {"anchor_grads": [torch.randn(p.shape, generator=g).to(dtype=p.dtype, device=p.device) for p in params]}

    def present(self, kwargs, correction, scales):
        return ("D", "acc") + (("anchor_grad",) if kwargs.get("variance_reduction") else ())


DESCRIPTOR = algorithm.register(
    _PAdaMFed(
        "padamfed",
        PAdaMFed,
        BatchedPAdaMFed,
        title="Problem-Parameter-Free Federated Learning",
        settings=("beta",),
        refusals={
            "momentum": "its optimizer has none",
            "weight_decay": "its client step has no weight decay term",
            "clip_norm": "its steps are normalized",
            "round_decay": "its step sizes come from theory_hparams",
        },
        variants=(
            Variant("padamfed", "padamfed"),
            Variant("padamfed-vr", "padamfed", options={"variance_reduction": True}),
        ),
        round_outputs=("local_control",),
        full="controls",
        options={
            "plain": dict(lr=0.05, beta=0.5),
            "controls": dict(lr=0.05, beta=0.3, controls=True),
            "vr": dict(lr=0.02, beta=0.4, variance_reduction=True, controls=True),
            "groups": dict(lr=0.05, beta=0.5, controls=True, groups=dict(lr=0.01, beta=0.9)),
        },
    )
)
