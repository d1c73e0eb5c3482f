"""``fedopt-sim``'s user-level differential privacy options (docs/privacy.md): the parser group, the
settings they give, and what the run says about its privacy."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, Optional

from ...privacy.accounting import ACCOUNTANTS, SAMPLINGS
from ..config import SimConfig

FIELDS = (
    "sampling",
    "dp_clip",
    "dp_noise_multiplier",
    "dp_target_epsilon",
    "dp_delta",
    "dp_adaptive_quantile",
    "dp_clip_lr",
    "dp_accountant",
    "dp_max_epsilon",
)


def add_privacy_options(p: argparse.ArgumentParser) -> None:
    d = SimConfig()
    g = p.add_argument_group("user-level differential privacy (docs/privacy.md; needs the [privacy] extra)")
    g.add_argument(
        "--sampling",
        choices=SAMPLINGS,
        default=d.sampling,
        help="fixed: --clients-per-round (or the rate's share) of the clients; poisson: each client joins "
        "with probability --sample-rate (or --clients-per-round / N) (default %(default)s)",
    )
    g.add_argument("--dp-clip", type=float, metavar="C", help="clip each client's reply to global L2 norm C (DP on)")
    g.add_argument("--dp-noise-multiplier", type=float, metavar="Z", help="noise std z*C per coordinate of the sums")
    g.add_argument(
        "--dp-target-epsilon", type=float, metavar="EPS", help="instead of Z: the z that spends EPS in --rounds rounds"
    )
    g.add_argument("--dp-delta", type=float, help="delta of the (epsilon, delta) guarantee (default 1/N^1.1)")
    g.add_argument(
        "--dp-adaptive-quantile", type=float, metavar="GAMMA", help="adapt C toward this quantile of the reply norms"
    )
    g.add_argument("--dp-clip-lr", type=float, default=d.dp_clip_lr, help="adaptive clip's learning rate (default 0.2)")
    g.add_argument("--dp-accountant", choices=ACCOUNTANTS, default=d.dp_accountant, help="default %(default)s")
    g.add_argument("--dp-max-epsilon", type=float, help="stop (after checkpointing) before a round would spend more")


def privacy_settings(args: argparse.Namespace) -> Dict[str, Any]:
    """The SimConfig fields of the options above."""
    return {name: getattr(args, name) for name in FIELDS}


def say_noise(cfg: SimConfig) -> None:
    """Calibrate ``--dp-target-epsilon`` and check the adaptive clip's share of the noise before anything
    starts (an unreachable target is bad input), and say the noise multiplier chosen."""
    if cfg.dp_clip is None:
        return
    from ...privacy.adaptive import update_noise_multiplier
    from ..dp_round import delta_of, noise_multiplier, sampling_of

    z = noise_multiplier(cfg)
    if cfg.dp_target_epsilon is not None:
        print(
            f"fedopt-sim: noise multiplier {z:.4g} spends epsilon {cfg.dp_target_epsilon:g} at delta "
            f"{delta_of(cfg):.3g} in {cfg.rounds} rounds ({cfg.dp_accountant}, {cfg.sampling} sampling)",
            file=sys.stderr,
        )
    if cfg.dp_adaptive_quantile is not None:
        update_noise_multiplier(z, sampling_of(cfg).expected / 20)


def epsilon_text(privacy: Optional[Dict[str, Any]]) -> str:
    """``; epsilon E at delta D (z Z, clip C)`` for the run's summary line, or nothing without DP."""
    if privacy is None:
        return ""
    text = (
        f"; epsilon {privacy['epsilon']:.4g} at delta {privacy['delta']:.3g} after {privacy['rounds']} rounds "
        f"(z {privacy['noise_multiplier']:.4g}, clip {privacy['clip']:.4g})"
    )
    return text + (f"; {privacy['stopped']}" if privacy["stopped"] else "")
