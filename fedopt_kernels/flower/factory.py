"""The Flower strategy for any ``fedopt-sim`` algorithm, from its settings (``FLConfig``)."""

from __future__ import annotations

from typing import Any

from ..fl.config import FLConfig
from ..fl.server_rules import RULES
from .averaging import AveragingStrategy
from .base import FedOptStrategy
from .initial_controls import InitialControlsStrategy


def strategy_for(cfg: FLConfig, **strategy_kw: Any) -> FedOptStrategy:
    """The strategy running ``cfg.algorithm`` with ``cfg``'s options and ``cfg.hparams()``.

    Sampling follows ``cfg`` too (``clients_per_round``, else ``sample_rate``) unless
    ``strategy_kw`` overrides it; the other keywords are ``FedOptStrategy``'s.
    """
    if not isinstance(cfg, FLConfig):
        raise TypeError(f"cfg must be a fedopt_kernels.FLConfig (or a sim.SimConfig), got {type(cfg).__name__}")
    cfg.validate()
    if "clients_per_round" not in strategy_kw and "fraction_train" not in strategy_kw:
        if cfg.clients_per_round is not None:
            strategy_kw["clients_per_round"] = cfg.clients_per_round
        else:
            strategy_kw["fraction_train"] = cfg.sample_rate
    cls = InitialControlsStrategy if RULES[cfg.server_rule].init_controls else AveragingStrategy
    return cls(cfg, **strategy_kw)
