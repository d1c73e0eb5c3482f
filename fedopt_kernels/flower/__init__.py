"""The package's FL algorithms on Flower (``pip install "fedopt_kernels[flower]"``), Message API.

Strategies (server side, ``flwr.serverapp.strategy.Strategy`` subclasses), named apart from the
optimizers they drive and generated from their declarations (``named.py``): one per
``FlowerName`` of ``paper_names.py`` (``FedDecayStrategy``, ``ScaffoldStrategy``,
``FedNLRStrategy``, ``FedNARStrategy`` with backbone fedavg / fedprox / scaffold,
``PAdaMFedStrategy`` and ``variance_reduction=True``, ``FedDynStrategy``, ``FedSAMStrategy``, ...;
``named.names()`` lists them), or ``strategy_for(FLConfig(...))`` for any ``fedopt-sim`` algorithm
(a simulator ``SimConfig`` works too): an ``AveragingStrategy`` or, for a rule with an initial round
of client controls, an ``InitialControlsStrategy``. Their server rules are
``fedopt_kernels.fl.server_rules``'s, shared with the simulator. ``DPFedAvgStrategy(strategy, dp_clip=...)``
puts any of them under user-level differential privacy as ``fedopt-sim --dp-clip`` does
(docs/privacy.md). Client side: ``train_round`` /
``init_controls_round`` / ``evaluate_round`` run a round with this package's optimizers from a
received message. ``apps`` holds a ready ServerApp/ClientApp pair on the simulator's data sets
(see ``examples/flower-digits``).

The earlier names ``FedDecay``, ``FedNLR``, ``FedNAR``, ``Scaffold``, ``PAdaMFed`` and
``padamfed_init_round`` still import, with a ``DeprecationWarning``.
"""

try:
    import flwr  # noqa: F401
    from flwr.serverapp.strategy import Strategy as _Strategy  # noqa: F401  (the Message API, flwr >= 1.21)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fedopt_kernels.flower needs Flower (flwr >= 1.42, its Message API; Python >= 3.11); install it with: "
        'pip install "fedopt_kernels[flower]"'
    ) from exc

import warnings as _warnings
from typing import Any as _Any

from ..fl.config import FLConfig
from . import named as _named
from .averaging import AveragingStrategy
from .base import ClientResult, FedOptStrategy, Rejection
from .client import evaluate_round, init_controls_round, train_round
from .factory import strategy_for
from .initial_controls import INIT_MESSAGE_TYPE, InitialControlsStrategy
from .privacy import DPFedAvgStrategy
from .records import BadUpdate, from_record, to_record

__all__ = [
    "AveragingStrategy",
    "InitialControlsStrategy",
    *_named.names(),  # the paper-named strategies the descriptors declare
    "FedOptStrategy",
    "DPFedAvgStrategy",
    "ClientResult",
    "Rejection",
    "BadUpdate",
    "INIT_MESSAGE_TYPE",
    "strategy_for",
    "train_round",
    "init_controls_round",
    "evaluate_round",
    "to_record",
    "from_record",
    "FLConfig",
]

# earlier names: the strategies shared their names with the optimizers (fedopt_kernels.FedNAR) and
# the server rules; they still import, with a warning naming the new one
_RENAMED = {
    "FedDecay": "FedDecayStrategy",
    "FedNLR": "FedNLRStrategy",
    "FedNAR": "FedNARStrategy",
    "Scaffold": "ScaffoldStrategy",
    "PAdaMFed": "PAdaMFedStrategy",
    "padamfed_init_round": "init_controls_round",
}


def __getattr__(name: str) -> _Any:
    if name in _named.names():  # generated on first use, from the descriptor that declares it
        return _named.named_strategy(name)
    if name in _RENAMED:
        new = _RENAMED[name]
        _warnings.warn(f"fedopt_kernels.flower.{name} is now {new}", DeprecationWarning, stacklevel=2)
        return __getattr__(new) if new in _named.names() else globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
