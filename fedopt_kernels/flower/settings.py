"""What a client must know to train one round, as it travels in the message's ``ConfigRecord``.

The algorithm is described by the simulator's own ``SimConfig`` (its algorithm name and optimizer
options) and the hyperparameters ``SimConfig.hparams()`` resolved from it, so that a Flower client
builds exactly the optimizer a ``fedopt-sim`` client builds (``sim.local.ClientOptimizers``).
Keys are the ``SimConfig`` / hparams names; ``clip_norm`` is left out when it is None (a
ConfigRecord has no None).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from flwr.app import ConfigRecord

from ..sim.config import ALGORITHMS, SimConfig

# SimConfig fields the client optimizer reads (sim/local.py), besides the hparams
OPTIMIZER_FIELDS = ("algorithm", "local_steps", "decay_schedule", "decay_every", "momentum", "weight_decay",
                    "nlr_mu0", "nlr_c1", "nlr_c2")
HPARAMS = ("lr", "server_lr", "beta", "prox_mu", "clip_norm", "round_decay")
ROUND_INDEX = "round-index"   # t, 0-based, counted over the whole run (FedNAR anneals by it)
STATE_TAG = "state-tag"       # client state keys are prefixed by it (several algorithms in one run)


def round_config(cfg: SimConfig, hp: Mapping[str, Any], t: int, tag: str) -> ConfigRecord:
    """The ConfigRecord of round ``t`` for the algorithm ``cfg`` with resolved hparams ``hp``."""
    out: Dict[str, Any] = {f: getattr(cfg, f) for f in OPTIMIZER_FIELDS}
    out.update({k: hp[k] for k in HPARAMS if hp.get(k) is not None})
    out[ROUND_INDEX] = int(t)
    out[STATE_TAG] = tag
    return ConfigRecord(out)


def read_round_config(config: Mapping[str, Any]) -> Tuple[SimConfig, Dict[str, Any], int, str]:
    """``(cfg, hp, t, tag)`` back from a received config; ValueError naming a missing or bad key."""
    for key in OPTIMIZER_FIELDS + ("lr", "server_lr", "beta", "prox_mu", "round_decay", ROUND_INDEX, STATE_TAG):
        if key not in config:
            raise ValueError(f"the round's config has no {key!r}: was it sent by a fedopt_kernels.flower strategy?")
    if config["algorithm"] not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {tuple(ALGORITHMS)}, got {config['algorithm']!r}")
    cfg = SimConfig(**{f: config[f] for f in OPTIMIZER_FIELDS})
    hp = {k: config.get(k) for k in HPARAMS}
    t = config[ROUND_INDEX]
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(f"{ROUND_INDEX} must be an integer >= 0, got {t!r}")
    return cfg, hp, t, str(config[STATE_TAG])
