"""Strategies of rules with initial controls (PAdaMFed's) on Flower: global momentum and control
variate on the server, ``c_i`` on each client.

Before the first round every client computes its initial control (the mean of K stochastic
gradients at the initial model) in a ``"train.init_controls"`` message and keeps it; the server
averages the replies into ``c`` and ``m`` (``fedopt_kernels.optim.padamfed.padamfed_init``). Each round sends
``c`` and ``m`` with the model; the server step is ``padamfed_step`` there.
"""

from __future__ import annotations

from typing import Any, Optional

from ..fl.config import FLConfig
from ..fl.server_rules import ServerRule
from .base import INIT_MESSAGE_TYPE, FedOptStrategy, check_count

__all__ = ["INIT_MESSAGE_TYPE", "InitialControlsStrategy", "PAdaMFedStrategy"]


class InitialControlsStrategy(FedOptStrategy):
    """The strategy of every server rule with an initial round of client controls; today PAdaMFed's
    server ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao; Alg. 1).

    With S accepted clients of N (``num_clients``), client lr eta, K local steps, server step gamma::

        x' = x + gamma * mean_i(y_i - x) / (eta * K)
        m' = beta * (sum_i dc_i / S + c) + (1 - beta) * m
        c' = c + sum_i dc_i / N                        (dc_i = c_i' - c_i, sent by client i)

    Built from an ``FLConfig`` (algorithm "padamfed" or "padamfed-vr"); ``PAdaMFedStrategy`` is the
    keyword constructor with the theory step sizes as defaults. The initial round, the server
    tensors and their update are the rule's (``fedopt_kernels.fl.server_rules``), as in the simulator.
    """

    @classmethod
    def _implements(cls, rule: ServerRule) -> bool:
        return rule.init_controls


class PAdaMFedStrategy(InitialControlsStrategy):
    """PAdaMFed with its theory step sizes: ``theory_hparams(clients_per_round, local_steps, num_rounds)``
    gives eta (client ``lr``), gamma (``server_lr``) and ``beta`` unless they are given.

    ``variance_reduction=True`` is PAdaMFed-VR (each client step also takes the same mini-batch's
    gradient at the round's starting model). ``clients_per_round`` is also the number sampled.
    """

    def __init__(
        self,
        *,
        num_rounds: int,
        clients_per_round: int,
        local_steps: int = 10,
        variance_reduction: bool = False,
        lr: Optional[float] = None,
        server_lr: Optional[float] = None,
        beta: Optional[float] = None,
        **strategy_kw: Any,
    ):
        check_count("num_rounds", num_rounds, optional=False)
        check_count("clients_per_round", clients_per_round, optional=False)
        if "fraction_train" in strategy_kw:
            raise ValueError("PAdaMFed samples clients_per_round clients; fraction_train does not apply")
        algorithm = "padamfed-vr" if variance_reduction else "padamfed"
        cfg = FLConfig(
            algorithm=algorithm,
            rounds=num_rounds,
            clients=clients_per_round,
            holdout_fraction=0.0,
            clients_per_round=clients_per_round,
            local_steps=local_steps,
            lr=lr,
            server_lr=server_lr,
            beta=beta,
        )
        super().__init__(cfg, clients_per_round=clients_per_round, **strategy_kw)
