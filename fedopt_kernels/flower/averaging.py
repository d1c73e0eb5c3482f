"""The strategy of every server rule without an initial round (FedAvg's, SCAFFOLD's, FedDyn's, ...).

The server step is the run's server rule (``fedopt_kernels.fl.server_rules``): with SCAFFOLD (and
the variants on it) the server also keeps the control variate ``c``, sends it with every round and
updates it; each client keeps its own ``c_i`` (``client.train_round``). The paper-named
constructors (``FedNARStrategy`` ...) are generated from the descriptors (``named.py``).
"""

from __future__ import annotations

from ..fl.server_rules import ServerRule
from .base import FedOptStrategy


class AveragingStrategy(FedOptStrategy):
    """The strategy of every server rule without an initial round: FedAvg's
    ``x += server_lr * sum_i n_i delta_i / sum_i n_i``, plus the rule's server tensors (SCAFFOLD's
    control variate: "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", Karimireddy et
    al., ICML 2020, option II: ``c += sum_{i in S} (c_i' - c_i) / N``, where N is ``num_clients``).
    Built from an ``FLConfig``; the paper-named subclasses (``FedNARStrategy`` …, ``named.py``) are
    keyword constructors.
    """

    @classmethod
    def _implements(cls, rule: ServerRule) -> bool:
        return not rule.init_controls
