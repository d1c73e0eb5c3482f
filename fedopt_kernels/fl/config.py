"""The settings of an FL algorithm's run, shared by the simulator and the Flower strategies.

``FLConfig`` holds what decides the algorithm's arithmetic: its name (a registered variant such as
``fedavg``, ``scaffold`` or ``fednar``), the sampling sizes PAdaMFed's theory step sizes read, the
client and server hyperparameters several algorithms share, and every registered algorithm's own
settings (``Setting``, declared in the algorithm's descriptor module: FedDyn's ``dyn_alpha``, ...), which are
fields of the class as much as the shared ones. The simulator's ``SimConfig`` extends it with data,
model and execution settings; a Flower strategy needs only this.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, TypeVar, cast

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # torch depends on typing_extensions
    from typing_extensions import dataclass_transform

from . import algorithm as _algorithm
from . import server_step as _server_step
from .work import check_work_options


def check_choice(name: str, value: Any, options) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")


def check_integer(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_real(
    name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo = f"{'>' if low_open else '>='} {low}"
        hi = "" if high == math.inf else f" and {'<' if high_open else '<='} {high}"
        raise ValueError(f"{name} must be a finite number {lo}{hi}, got {value!r}")


def _setting(
    default: Any,
    kind: type,
    help: str,
    *,
    low: float = 0.0,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    choices: Optional[tuple] = None,
    some: bool = False,
) -> Any:
    """A field that is also a ``fedopt-sim`` option (``--name-with-dashes``, in its "algorithm" group),
    with its range (``validate`` checks it; None is "the default" where the default is None).

    ``some``: only some algorithms take it; a run of another one refuses it when it is set
    (``Algorithm.settings`` lists the ones an algorithm takes)."""
    return field(
        default=default,
        metadata={
            "cli": help,
            "type": kind,
            "choices": choices,
            "some": some,
            "range": (low, high, low_open, high_open),
        },
    )


def algorithm_settings(cfg_type: type) -> List[Any]:
    """The fields of ``cfg_type`` that are ``fedopt-sim`` options of the "algorithm" group."""
    return [f for f in dataclasses.fields(cfg_type) if "cli" in f.metadata]


_Config = TypeVar("_Config", bound="FLConfig")
_Class = TypeVar("_Class", bound=type)


@dataclass_transform(field_specifiers=(field,))
def _with_algorithm_settings(cls: _Class) -> _Class:
    """``cls`` as a dataclass whose fields are its own and then every registered algorithm's own
    settings (``algorithm.Setting``, declared in the algorithm's descriptor module), each made by ``_setting``
    with ``some=True``: only the algorithms that take it accept it."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for s in _algorithm.settings_for_config():
        annotations[s.name] = Optional[s.kind] if s.default is None else s.kind
        made = _setting(
            s.default,
            s.kind,
            s.help,
            low=s.low,
            high=s.high,
            low_open=s.low_open,
            high_open=s.high_open,
            choices=s.choices,
            some=True,
        )
        setattr(cls, s.name, made)
    cls.__annotations__ = annotations
    return cast(_Class, dataclass(cls))


@_with_algorithm_settings
class FLConfig:
    """An FL algorithm's settings; ``None`` means "the algorithm's default" (see ``hparams()``).

    Besides the fields below, every registered algorithm's own settings (``dyn_alpha``,
    ``nlr_mu0``, ...: ``fedopt_kernels.fl.algorithm.SETTINGS``) are fields.
    """

    algorithm: str = "fedavg"
    clients: int = 50  # all users, held-out new users included
    holdout_fraction: float = 0.2  # new users: never train, evaluated after fine-tuning
    rounds: int = 50
    local_steps: int = 10
    batch_size: int = 10
    sample_rate: float = 0.2  # fraction of the training clients sampled per round
    clients_per_round: Optional[int] = None  # overrides sample_rate
    # clients that differ in their work (fl/work.py): each client's local steps in a round
    local_epochs: Optional[int] = None  # client i: local_epochs * ceil(n_i / batch_size) steps
    local_steps_range: Optional[Tuple[int, int]] = None  # (a, b): drawn per client and round from a..b
    stragglers: float = 0.0  # this fraction of a round's clients stops after a uniform fraction of its steps
    lr: Optional[float] = _setting(
        None, float, "client learning rate (default 0.05; PAdaMFed: eta from theory_hparams)"
    )
    lr_scale: float = _setting(
        1.0, float, "multiply the client lr (default %(default)s; for lr-robustness sweeps)", low_open=True
    )
    server_lr: Optional[float] = _setting(
        None,
        float,
        "server learning rate (default 1; adam, yogi, adagrad: 1e-2; PAdaMFed: gamma from theory)",
        low_open=True,
    )
    beta: Optional[float] = _setting(
        None,
        float,
        "FedDecay decay factor (default 0.5 for feddecay, 1 for fedprox/"
        "scaffold) or PAdaMFed momentum parameter (default from theory)",
        high=1.0,
        some=True,
    )
    decay_schedule: str = _setting("exponential", str, "within-round decay schedule", choices=("exponential", "linear"))
    decay_every: int = _setting(1, int, "local steps per decay period (default %(default)s)", low=1)
    momentum: float = _setting(0.0, float, "client momentum (default %(default)s)", high=1.0, high_open=True, some=True)
    weight_decay: float = _setting(0.0, float, "client weight decay (default %(default)s)", some=True)
    prox_mu: Optional[float] = _setting(None, float, "FedProx coefficient, for the FedProx variants (default 0.01)")
    clip_norm: Optional[float] = _setting(
        None, float, "FedNAR max_norm (default 10); gradient clipping for SGD algorithms", low_open=True, some=True
    )
    round_decay: Optional[float] = _setting(
        None,
        float,
        "client lr *= round_decay**t (default 0.998 for FedNAR, else 1)",
        high=1.0,
        low_open=True,
        some=True,
    )
    # the server optimizer on each round's aggregate (fl/server_step.py; docs/algorithms.md)
    server_optimizer: str = _setting(
        "sgd",
        str,
        "the server's optimizer on the round's aggregate: sgd (x += server_lr * aggregate), avgm (FedAvgM), "
        "adam, yogi, adagrad (Reddi et al.), exp (FedExP)",
        choices=_server_step.NAMES,
    )
    server_momentum: Optional[float] = _setting(None, float, "avgm: momentum (default 0.9)", high=1.0, high_open=True)
    server_nesterov: bool = _setting(False, bool, "avgm: Nesterov momentum")
    server_beta1: Optional[float] = _setting(
        None, float, "adam, yogi, adagrad: first-moment decay (default 0.9)", high=1.0, high_open=True
    )
    server_beta2: Optional[float] = _setting(
        None, float, "adam, yogi: second-moment decay (default 0.99)", high=1.0, high_open=True
    )
    server_tau: Optional[float] = _setting(
        None, float, "adam, yogi, adagrad: adaptivity tau, added to sqrt(v) (default 1e-3)", low_open=True
    )
    server_initial_accumulator: Optional[float] = _setting(
        None, float, "adam, yogi, adagrad: v's value before the first round (default tau**2)"
    )
    server_bias_correction: bool = _setting(False, bool, "adam, yogi, adagrad: divide m and v by 1 - beta**t")
    server_eps: Optional[float] = _setting(
        None, float, "exp: epsilon of FedExP's step size (default 1e-3)", low_open=True
    )
    backend: str = "auto"
    seed: int = 0

    # ------------------------------------------------------------------ the algorithm
    @property
    def variant(self) -> _algorithm.Variant:
        return _algorithm.variant(self.algorithm)

    @property
    def algo(self) -> _algorithm.Algorithm:
        """The descriptor of the algorithm the clients train with."""
        return _algorithm.of(self.algorithm)

    @property
    def server_rule(self) -> str:
        return self.variant.server

    @property
    def client_optimizer(self) -> str:
        """The registered algorithm whose optimizer the clients use (e.g. "feddecay" for fedavg)."""
        return self.variant.algorithm

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_holdout(self) -> int:
        return int(round(self.holdout_fraction * self.clients))

    @property
    def num_train_clients(self) -> int:
        return self.clients - self.num_holdout

    @property
    def sampled_per_round(self) -> int:
        if self.clients_per_round is not None:
            return self.clients_per_round
        return max(1, int(round(self.sample_rate * self.num_train_clients)))

    # ------------------------------------------------------------------ checks
    def validate(self) -> FLConfig:
        """Raise ValueError naming the first parameter that is out of range; return self."""
        self.validate_algorithm()
        return self

    def validate_algorithm(self) -> None:
        """The algorithm's settings and the sampling sizes they depend on."""
        check_choice("algorithm", self.algorithm, _algorithm.VARIANTS)
        check_integer("clients", self.clients, 1)
        check_real("holdout_fraction", self.holdout_fraction, 0.0, 1.0, high_open=True)
        if self.num_train_clients < 1:
            raise ValueError(
                f"clients={self.clients} with holdout_fraction={self.holdout_fraction} leaves no training clients"
            )
        check_integer("rounds", self.rounds, 1)
        check_integer("local_steps", self.local_steps, 1)
        check_integer("batch_size", self.batch_size, 1)
        check_real("sample_rate", self.sample_rate, 0.0, 1.0, low_open=True)
        if self.clients_per_round is not None:
            check_integer("clients_per_round", self.clients_per_round, 1)
            if self.clients_per_round > self.num_train_clients:
                raise ValueError(
                    f"clients_per_round={self.clients_per_round} is more than the "
                    f"{self.num_train_clients} training clients ({self.clients} clients, "
                    f"{self.num_holdout} held out as new users)"
                )
        check_work_options(self)
        for f in algorithm_settings(type(self)):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            if f.metadata["choices"]:
                check_choice(f.name, value, f.metadata["choices"])
            elif f.metadata["type"] is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be True or False, got {value!r}")
            elif f.metadata["type"] is int:
                check_integer(f.name, value, int(f.metadata["range"][0]))
            else:
                low, high, low_open, high_open = f.metadata["range"]
                check_real(f.name, value, low, high, low_open=low_open, high_open=high_open)
        self.algo.check(self, self.variant)
        _server_step.check(self)
        if not isinstance(self.backend, str):
            raise ValueError(f"backend must be a string, got {self.backend!r}")
        check_integer("seed", self.seed, 0)

    # ------------------------------------------------------------------ defaults
    def hparams(self) -> Dict[str, Any]:
        """Client lr, server lr, beta, prox_mu, clip_norm, round_decay (+ the algorithm's own) with defaults
        (``server_lr``: the server optimizer's, ``server_step.DEFAULTS``, where it has one)."""
        hp = self.algo.hparams(self, self.variant)
        if self.server_lr is None and "server_lr" in _server_step.DEFAULTS.get(self.server_optimizer, {}):
            hp["server_lr"] = _server_step.setting(self, "server_lr")
        return hp

    def replace(self: _Config, **changes: Any) -> _Config:
        """A copy with ``changes`` (of the same class: a SimConfig's is a SimConfig)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)
