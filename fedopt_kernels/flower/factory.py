"""The Flower strategy for any ``fedopt-sim`` algorithm, from the simulator's config."""
from __future__ import annotations

from typing import Any

from ..sim.config import SimConfig
from .averaging import AveragingStrategy
from .base import FedOptStrategy
from .padamfed import PAdaMFedStrategy


def strategy_for(cfg: SimConfig, **strategy_kw: Any) -> FedOptStrategy:
    """The strategy running ``cfg.algorithm`` with ``cfg``'s options and ``cfg.hparams()``.

    Sampling follows ``cfg`` too (``clients_per_round``, else ``sample_rate``) unless
    ``strategy_kw`` overrides it; the other keywords are ``FedOptStrategy``'s.
    """
    if not isinstance(cfg, SimConfig):
        raise TypeError(f"cfg must be a fedopt_kernels.sim.SimConfig, got {type(cfg).__name__}")
    cfg.validate()
    if "clients_per_round" not in strategy_kw and "fraction_train" not in strategy_kw:
        if cfg.clients_per_round is not None:
            strategy_kw["clients_per_round"] = cfg.clients_per_round
        else:
            strategy_kw["fraction_train"] = cfg.sample_rate
    cls = PAdaMFedStrategy if cfg.server_rule == "padamfed" else AveragingStrategy
    return cls(cfg, **strategy_kw)
