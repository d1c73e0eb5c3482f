"""Strategies of rules with initial controls (PAdaMFed's) on Flower: global momentum and control
variate on the server, ``c_i`` on each client.

Before the first round every client computes its initial control (the mean of K stochastic
gradients at the initial model) in a ``"train.init_controls"`` message and keeps it; the server
averages the replies into ``c`` and ``m`` (``fedopt_kernels.fl.algorithms.padamfed.padamfed_init``). Each round sends
``c`` and ``m`` with the model; the server step is ``padamfed_step`` there.
"""

from __future__ import annotations

from ..fl.server_rules import ServerRule
from .base import INIT_MESSAGE_TYPE, FedOptStrategy

__all__ = ["INIT_MESSAGE_TYPE", "InitialControlsStrategy"]


class InitialControlsStrategy(FedOptStrategy):
    """The strategy of every server rule with an initial round of client controls; today PAdaMFed's
    server ("Problem-Parameter-Free Federated Learning", Yan, Zhang, Wang, Cao; Alg. 1).

    With S accepted clients of N (``num_clients``), client lr eta, K local steps, server step gamma::

        x' = x + gamma * mean_i(y_i - x) / (eta * K)
        m' = beta * (sum_i dc_i / S + c) + (1 - beta) * m
        c' = c + sum_i dc_i / N                        (dc_i = c_i' - c_i, sent by client i)

    Built from an ``FLConfig`` (a PAdaMFed variant); ``PAdaMFedStrategy`` (generated from its
    declaration, ``named.py``) is the keyword constructor with the theory step sizes as defaults. The
    initial round, the server tensors and their update are the rule's (``fl/algorithms/padamfed.py``), as in
    the simulator.
    """

    @classmethod
    def _implements(cls, rule: ServerRule) -> bool:
        return rule.init_controls
