"""Strategies whose server averages model deltas: FedDecay, FedNLR, FedNAR (on FedAvg, FedProx, SCAFFOLD), SCAFFOLD.

The server step is the run's server rule (``fedopt_kernels.fl.server_rules``): with SCAFFOLD (and
FedNAR-SCAFFOLD) the server also keeps the control variate ``c``, sends it with every round and
updates it; each client keeps its own ``c_i`` (``client.train_round``).
"""

from __future__ import annotations

from typing import Any, Optional

from ..fl.config import FLConfig
from ..fl.server_rules import ServerRule
from .base import FedOptStrategy


class AveragingStrategy(FedOptStrategy):
    """The strategy of every server rule without an initial round: FedAvg's
    ``x += server_lr * sum_i n_i delta_i / sum_i n_i``, plus the rule's server tensors (SCAFFOLD's
    control variate: "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", Karimireddy et
    al., ICML 2020, option II: ``c += sum_{i in S} (c_i' - c_i) / N``, where N is ``num_clients``).
    Built from an ``FLConfig``; the paper-named subclasses (``FedNARStrategy`` …) are keyword constructors.
    """

    @classmethod
    def _implements(cls, rule: ServerRule) -> bool:
        return not rule.init_controls


class FedDecayStrategy(AveragingStrategy):
    """FedDecay: within-round learning-rate decay ``lr_k = lr * beta ** (k // decay_every)`` on FedAvg.

    "FedDecay: Adapting to Data Heterogeneity in Federated Learning with Gradient Decay" and its
    extended version, "Balancing Model Performance and Rapid Personalization in Federated Learning
    with Learning-Rate Scheduling". ``beta=1`` is FedAvg, ``beta=0`` FedSGD. Clients train with
    ``FedDecaySGD``; the lr of round t is ``lr * round_decay ** t``.
    """

    def __init__(
        self,
        beta: float,
        *,
        lr: float = 0.05,
        server_lr: float = 1.0,
        local_steps: int = 10,
        decay_schedule: str = "exponential",
        decay_every: int = 1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        clip_norm: Optional[float] = None,
        round_decay: float = 1.0,
        **strategy_kw: Any,
    ):
        super().__init__(
            FLConfig(
                algorithm="feddecay",
                beta=beta,
                lr=lr,
                server_lr=server_lr,
                local_steps=local_steps,
                decay_schedule=decay_schedule,
                decay_every=decay_every,
                momentum=momentum,
                weight_decay=weight_decay,
                clip_norm=clip_norm,
                round_decay=round_decay,
            ),
            **strategy_kw,
        )


class FedNLRStrategy(AveragingStrategy):
    """FedNLR: neuron-wise learning rates ``r = M * softmax(hbar / T)`` from the received model's activations.

    "FedNLR: Federated Learning with Neuron-wise Learning Rates" (Wang et al., KDD 2024). Clients train with
    ``NeuronLRSGD``, recalibrating the scales every round on their training data (``mu0``,
    ``c1``, ``c2``: the scale-range constants); the server averages like FedAvg.
    """

    def __init__(
        self,
        *,
        lr: float = 0.05,
        server_lr: float = 1.0,
        local_steps: int = 10,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        clip_norm: Optional[float] = None,
        round_decay: float = 1.0,
        mu0: float = 1.0,
        c1: float = 1.0,
        c2: float = 1.0,
        **strategy_kw: Any,
    ):
        super().__init__(
            FLConfig(
                algorithm="fednlr",
                lr=lr,
                server_lr=server_lr,
                local_steps=local_steps,
                momentum=momentum,
                weight_decay=weight_decay,
                clip_norm=clip_norm,
                round_decay=round_decay,
                nlr_mu0=mu0,
                nlr_c1=c1,
                nlr_c2=c2,
            ),
            **strategy_kw,
        )


class FedNARStrategy(AveragingStrategy):
    """FedNAR: co-clipping of gradient and weight decay, ``x -= l_t * min(1, max_norm / ||d||) * d``.

    "FedNAR: Federated Optimization with Normalized Annealing Regularization" (Li et al., NeurIPS
    2023), with ``d = g + weight_decay * x (+ prox_mu (x - x0) | + c - c_i)`` and
    ``l_t = lr * round_decay ** t``. ``backbone``: "fedavg", "fedprox" (``prox_mu``) or
    "scaffold" (server control variate, as ``ScaffoldStrategy``).
    """

    _ALGORITHMS = {"fedavg": "fednar", "fedprox": "fednar-fedprox", "scaffold": "fednar-scaffold"}

    def __init__(
        self,
        *,
        backbone: str = "fedavg",
        lr: float = 0.05,
        weight_decay: float = 0.0,
        max_norm: float = 10.0,
        round_decay: float = 0.998,
        prox_mu: Optional[float] = None,
        server_lr: float = 1.0,
        local_steps: int = 10,
        **strategy_kw: Any,
    ):
        if backbone not in self._ALGORITHMS:
            raise ValueError(f"backbone must be one of {tuple(self._ALGORITHMS)}, got {backbone!r}")
        super().__init__(
            FLConfig(
                algorithm=self._ALGORITHMS[backbone],
                lr=lr,
                weight_decay=weight_decay,
                clip_norm=max_norm,
                round_decay=round_decay,
                prox_mu=prox_mu,
                server_lr=server_lr,
                local_steps=local_steps,
            ),
            **strategy_kw,
        )


class ScaffoldStrategy(AveragingStrategy):
    """SCAFFOLD with option-II control variates; clients take SGD steps (``FedDecaySGD``, ``beta``
    for an optional within-round decay) corrected by ``c - c_i``.
    """

    def __init__(
        self,
        *,
        lr: float = 0.05,
        server_lr: float = 1.0,
        local_steps: int = 10,
        beta: float = 1.0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        clip_norm: Optional[float] = None,
        round_decay: float = 1.0,
        **strategy_kw: Any,
    ):
        super().__init__(
            FLConfig(
                algorithm="scaffold",
                lr=lr,
                server_lr=server_lr,
                local_steps=local_steps,
                beta=beta,
                momentum=momentum,
                weight_decay=weight_decay,
                clip_norm=clip_norm,
                round_decay=round_decay,
            ),
            **strategy_kw,
        )
