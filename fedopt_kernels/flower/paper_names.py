"""The package's paper-named Flower strategies (``FedNARStrategy``, ``FedDynStrategy``, ...), by the
variants they run: ``named.py`` generates each strategy class from its declaration here."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .naming import FlowerName, declare


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def strategy_keywords(
    *,
    num_rounds: int,
    clients_per_round: int,
    local_steps: int = 10,
    variance_reduction: bool = False,
    lr: Optional[float] = None,
    server_lr: Optional[float] = None,
    beta: Optional[float] = None,
    **strategy: Any,
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``PAdaMFedStrategy``'s keywords as (FLConfig keywords, strategy keywords): the theory step sizes
    ``theory_hparams(clients_per_round, local_steps, num_rounds)`` unless lr, server_lr, beta are given;
    ``clients_per_round`` is also the number sampled (so ``fraction_train`` does not apply)."""
    _count("num_rounds", num_rounds)
    _count("clients_per_round", clients_per_round)
    if "fraction_train" in strategy:
        raise ValueError("PAdaMFed samples clients_per_round clients; fraction_train does not apply")
    cfg = dict(
        algorithm="padamfed-vr" if variance_reduction else "padamfed",
        rounds=num_rounds,
        clients=clients_per_round,
        holdout_fraction=0.0,
        clients_per_round=clients_per_round,
        local_steps=local_steps,
        lr=lr,
        server_lr=server_lr,
        beta=beta,
    )
    return cfg, {"clients_per_round": clients_per_round, **strategy}


# in the order of the algorithms' registry (the README's table lists them so)
declare(
    FlowerName(
        "FedDecayStrategy",
        "feddecay",
        positional=("beta",),
        doc="Within-round learning-rate decay lr_k = lr * s(k // decay_every) on FedAvg (beta=1: FedAvg).",
    )
)
declare(FlowerName("ScaffoldStrategy", "scaffold", doc="SCAFFOLD (option II controls) on FedDecaySGD's SGD steps."))
declare(
    FlowerName(
        "FedNovaStrategy",
        {"fedavg": "fednova", "fedprox": "fednova-fedprox"},
        choose="backbone",
        doc="FedNova's normalized averaging (each update divided by its clients' step weights a_i) "
        "on FedAvg's or FedProx's clients.",
    )
)
declare(
    FlowerName(
        "FedNLRStrategy",
        "fednlr",
        aliases={"mu0": "nlr_mu0", "c1": "nlr_c1", "c2": "nlr_c2"},
        doc="Neuron-wise learning rates, recalibrated by every client on its data each round; FedAvg's server.",
    )
)
declare(
    FlowerName(
        "FedNARStrategy",
        {"fedavg": "fednar", "fedprox": "fednar-fedprox", "scaffold": "fednar-scaffold"},
        choose="backbone",
        aliases={"max_norm": "clip_norm"},
        doc="Co-clipping of gradient and weight decay on FedAvg, FedProx (prox_mu) or SCAFFOLD.",
    )
)
declare(
    FlowerName(
        "PAdaMFedStrategy",
        {False: "padamfed", True: "padamfed-vr"},
        choose="variance_reduction",
        keywords=strategy_keywords,
        doc="Keywords: num_rounds, clients_per_round (required), local_steps, variance_reduction, "
        "lr, server_lr, beta (default: the theory step sizes), and the strategy's.",
    )
)
declare(
    FlowerName(
        "FedDynStrategy",
        "feddyn",
        aliases={"alpha": "dyn_alpha"},
        doc="Dynamic regularization: each client keeps g_i, the server keeps h (FedDyn's rule).",
    )
)
declare(
    FlowerName(
        "FedSAMStrategy",
        {"fedavg": "fedsam", "scaffold": "fedsam-scaffold"},
        choose="backbone",
        aliases={"rho": "sam_rho"},
        doc="Sharpness-aware local steps on FedAvg or SCAFFOLD.",
    )
)
declare(
    FlowerName(
        "FedASAMStrategy",
        "fedasam",
        aliases={"rho": "sam_rho", "eta": "sam_eta"},
        doc="Adaptive (scale-invariant) sharpness-aware local steps on FedAvg.",
    )
)
