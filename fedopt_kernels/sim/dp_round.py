"""User-level differential privacy in the simulator: its settings' checks, the run's ``DPFedAvg``, and
what a round and a run add under it (docs/privacy.md).

The server clips each accepted reply before the fold adds it (``take`` in ``Simulation.run_round``:
the sequential engine reply by reply, the client-batched engine a chunk's replies at once with one
op, ``dp_chunk.py``), adds the round's noise to the fold's sums after the ranks' merge (so every
rank adds the same noise to the same sums), divides by the expected number of clients, moves the
adaptive clip and counts the round's privacy.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Dict, List, Optional

from ..core.extras import MissingExtra
from ..fl.fold import Fold
from ..fl.server_rules import RULES
from ..privacy.accounting import ACCOUNTANTS, SAMPLINGS, Sampling, calibrate, dp_accounting
from ..privacy.dp_fedavg import DPFedAvg

logger = logging.getLogger("fedopt_kernels.sim")

# the settings that only mean something with dp_clip
NEEDS_CLIP = ("dp_noise_multiplier", "dp_target_epsilon", "dp_delta", "dp_adaptive_quantile", "dp_max_epsilon")


def sampling_of(cfg: Any) -> Sampling:
    """The run's client sampling: ``sampled_per_round`` of N (fixed), or each client with probability
    ``clients_per_round / N`` when that is given, else ``sample_rate`` (Poisson)."""
    n = cfg.num_train_clients
    if cfg.sampling == "poisson":
        rate = cfg.clients_per_round / n if cfg.clients_per_round is not None else cfg.sample_rate
        return Sampling("poisson", n, rate=rate)
    return Sampling("fixed", n, per_round=cfg.sampled_per_round)


def delta_of(cfg: Any) -> float:
    """``dp_delta``, by default ``1 / N^1.1`` (N the training clients: below 1/N, as a guarantee needs)."""
    return cfg.dp_delta if cfg.dp_delta is not None else 1.0 / cfg.num_train_clients**1.1


def check(cfg: Any) -> None:
    """ValueError naming the first privacy setting out of range (nothing is computed)."""

    def real(name: str, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False) -> None:
        v = getattr(cfg, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        if not ok:
            lo, hi = "(" if low_open else "[", ")" if high_open else "]"
            raise ValueError(f"{name} must be a number in {lo}{low:g}, {high:g}{hi}, got {v!r}")

    if cfg.sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {cfg.sampling!r}")
    real("dp_clip_lr", 0.0, low_open=True)
    if cfg.dp_clip is None:
        for name in NEEDS_CLIP:
            if getattr(cfg, name) is not None:
                raise ValueError(f"{name} applies to user-level differential privacy: give dp_clip (--dp-clip) too")
        return
    try:
        dp_accounting()
    except MissingExtra as exc:
        raise ValueError(f"dp_clip: {exc}") from None

    real("dp_clip", 0.0, low_open=True)
    if cfg.server_optimizer == "exp":
        raise ValueError(
            "dp_clip does not compose with server_optimizer='exp': FedExP's step reads the clients' mean "
            "squared update norm, a statistic of their data that the noise does not cover"
        )
    scalars = RULES[cfg.server_rule].scalars
    if scalars:
        raise ValueError(
            f"dp_clip does not apply to algorithm={cfg.algorithm!r}: its server weighs each update by numbers "
            f"the client reports ({', '.join(scalars)}), which the clip and the noise do not cover"
        )
    if (cfg.dp_noise_multiplier is None) == (cfg.dp_target_epsilon is None):
        raise ValueError(
            "dp_clip needs exactly one of dp_noise_multiplier (--dp-noise-multiplier) and dp_target_epsilon "
            "(--dp-target-epsilon)"
        )
    if cfg.dp_noise_multiplier is not None:
        real("dp_noise_multiplier", 0.0)
    else:
        real("dp_target_epsilon", 0.0, low_open=True)
    if cfg.dp_delta is not None:
        real("dp_delta", 0.0, 1.0, low_open=True, high_open=True)
    if cfg.dp_adaptive_quantile is not None:
        real("dp_adaptive_quantile", 0.0, 1.0)
    if cfg.dp_max_epsilon is not None:
        real("dp_max_epsilon", 0.0, low_open=True)
    if cfg.dp_accountant not in ACCOUNTANTS:
        raise ValueError(f"dp_accountant must be one of {ACCOUNTANTS}, got {cfg.dp_accountant!r}")
    if cfg.dp_accountant == "pld" and cfg.sampling != "poisson":
        raise ValueError(
            "dp_accountant='pld' accounts Poisson sampling only: give sampling='poisson', or dp_accountant='rdp'"
        )


@functools.lru_cache(maxsize=16)
def _calibrated(sampling: Sampling, target: float, rounds: int, delta: float, kind: str) -> float:
    return calibrate(sampling, target, rounds, delta, kind)


def noise_multiplier(cfg: Any) -> float:
    """``dp_noise_multiplier``, or the z that ``dp_target_epsilon`` asks for over ``rounds`` rounds
    (calibrated once per settings: the CLI's check and the run share it)."""
    if cfg.dp_noise_multiplier is not None:
        return float(cfg.dp_noise_multiplier)
    return _calibrated(sampling_of(cfg), float(cfg.dp_target_epsilon), cfg.rounds, delta_of(cfg), cfg.dp_accountant)


def build(cfg: Any) -> Optional[DPFedAvg]:
    """The run's ``DPFedAvg``, or None without ``dp_clip``; ValueError naming the setting that cannot be met."""
    if cfg.dp_clip is None:
        return None
    return DPFedAvg(
        cfg.dp_clip,
        noise_multiplier(cfg),
        sampling_of(cfg),
        cfg.seed,
        delta_of(cfg),
        quantile=cfg.dp_adaptive_quantile,
        clip_lr=cfg.dp_clip_lr,
        accountant=cfg.dp_accountant,
    )


def poisson_sample(rng: Any, sampling: Sampling) -> List[int]:
    """Each of the N clients with probability q, one uniform draw each in client order (sorted ids)."""
    return [int(i) for i in (rng.random(sampling.population) < sampling.rate).nonzero()[0]]


def finish(sim: Any, fold: Fold, t: int) -> Dict[str, Any]:
    """Round ``t``'s noise, divisor, clip update and epsilon (``DPFedAvg.finish_round``), after the ranks'
    merge; the round record's entries."""
    dp: DPFedAvg = sim.privacy
    below = dp.below if sim.ranks.world == 1 else sum(sim.ranks.gather(dp.below))
    return dp.finish_round(fold, t, sim.strategy.rule.reply, below)


def over_budget(sim: Any, t: int) -> Optional[str]:
    """The message stopping the run before round ``t`` (0-based) when that round would spend more than
    ``dp_max_epsilon``; None otherwise."""
    limit = sim.cfg.dp_max_epsilon
    if sim.privacy is None or limit is None:
        return None
    eps = sim.privacy.epsilon_after(t + 1)
    if eps <= limit:
        return None
    return (
        f"stopped before round {t + 1}: it would spend epsilon {eps:.4g} at delta {sim.privacy.accountant.delta:.3g}, "
        f"more than dp_max_epsilon={limit:g}"
    )


def summary(sim: Any, stopped: Optional[str]) -> Optional[Dict[str, Any]]:
    """The run result's ``"privacy"`` entry (None without DP)."""
    dp: Optional[DPFedAvg] = sim.privacy
    if dp is None:
        return None
    return {
        "epsilon": dp.epsilon_after(dp.rounds),
        "delta": dp.accountant.delta,
        "rounds": dp.rounds,
        "noise_multiplier": dp.z,
        "update_noise_multiplier": dp.update_z,
        "clip": dp.clip_norm,
        "expected_clients": dp.expected,
        "sampling": dp.sampling.kind,
        "accountant": dp.accountant.kind,
        "stopped": stopped,
    }


def say_stopped(message: str) -> None:
    logger.warning("%s", message)
