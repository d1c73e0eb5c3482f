"""The package's FL algorithms on Flower (``pip install "fedopt_kernels[flower]"``), Message API.

Strategies (server side, ``flwr.serverapp.strategy.Strategy`` subclasses):
``FedDecay``, ``FedNLR``, ``FedNAR`` (backbone fedavg / fedprox / scaffold), ``Scaffold``,
``PAdaMFed`` (and ``variance_reduction=True``), or ``strategy_for(FLConfig(...))`` for any
``fedopt-sim`` algorithm (a simulator ``SimConfig`` works too). Their server rules are
``fedopt_kernels.fl.server_rules``'s, shared with the simulator. Client side: ``train_round`` /
``padamfed_init_round`` / ``evaluate_round`` run a round with this package's optimizers from a received message. ``apps`` holds a ready
ServerApp/ClientApp pair on the simulator's data sets (see ``examples/flower-digits``).
"""
try:
    import flwr  # noqa: F401
    from flwr.serverapp.strategy import Strategy as _Strategy  # noqa: F401  (the Message API, flwr >= 1.21)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'fedopt_kernels.flower needs Flower (flwr >= 1.42, its Message API; Python >= 3.11); install it with: '
        'pip install "fedopt_kernels[flower]"') from exc

from ..fl.config import FLConfig
from .averaging import AveragingStrategy, FedDecay, FedNAR, FedNLR, Scaffold
from .base import ClientResult, FedOptStrategy, Rejection
from .client import evaluate_round, padamfed_init_round, train_round
from .factory import strategy_for
from .padamfed import INIT_MESSAGE_TYPE, PAdaMFed, PAdaMFedStrategy
from .records import BadUpdate, from_record, to_record

__all__ = [
    "AveragingStrategy", "FedDecay", "FedNAR", "FedNLR", "Scaffold", "PAdaMFed", "PAdaMFedStrategy",
    "FedOptStrategy", "ClientResult", "Rejection", "BadUpdate", "INIT_MESSAGE_TYPE", "strategy_for",
    "train_round", "padamfed_init_round", "evaluate_round", "to_record", "from_record", "FLConfig",
]
