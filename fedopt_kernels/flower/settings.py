"""What a client must know to train one round, as it travels in the message's ``ConfigRecord``.

The algorithm is described by its ``FLConfig`` (the settings ``fedopt-sim`` runs it with) and the
hyperparameters ``FLConfig.hparams()`` resolved from it, so that a Flower client builds exactly the
optimizer a ``fedopt-sim`` client builds (the algorithm descriptor's ``make``). Keys are the
``FLConfig`` / hparams names; a None value is left out (a ConfigRecord has no None).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Tuple

from flwr.app import ConfigRecord

from ..fl import algorithm
from ..fl.config import FLConfig

# the hparams every algorithm has (the others may be None, which a ConfigRecord cannot hold: left out)
_ALWAYS = ("lr", "server_lr")
ROUND_INDEX = "round-index"  # t, 0-based, counted over the whole run (FedNAR anneals by it)
STATE_TAG = "state-tag"  # client state keys are prefixed by it (several algorithms in one run)
# checkpointing servers (flower/resume.py): rounds completed when the server (re)started, and the
# rounds of its newest checkpoint; clients keep their state files by them
RESUMED_AT = "resumed-at-round"
# clients that differ in their work (fl/work.py): a straggler's fraction u of its steps
WORK_FRACTION = "work-fraction"
CHECKPOINTED = "checkpointed-round"
_FIELDS = tuple(f.name for f in dataclasses.fields(FLConfig))


def round_config(cfg: FLConfig, hp: Mapping[str, Any], t: int, tag: str) -> ConfigRecord:
    """The ConfigRecord of round ``t`` for the algorithm ``cfg`` with resolved hparams ``hp``.

    The resolved hparams travel under their names; the algorithm's other settings under their
    ``FLConfig`` names (those the hparams resolve, e.g. ``lr``, are not sent twice).
    """
    out: Dict[str, Any] = {f: getattr(cfg, f) for f in _FIELDS if f not in hp and getattr(cfg, f) is not None}
    out.update({k: list(v) for k, v in out.items() if isinstance(v, tuple)})  # a ConfigRecord holds lists
    out.update({k: v for k, v in hp.items() if v is not None})
    out[ROUND_INDEX] = int(t)
    out[STATE_TAG] = tag
    return ConfigRecord(out)


def read_round_config(config: Mapping[str, Any]) -> Tuple[FLConfig, Dict[str, Any], int, str]:
    """``(cfg, hp, t, tag)`` back from a received config; ValueError naming a missing or bad key."""
    for key in ("algorithm", "local_steps") + _ALWAYS + (ROUND_INDEX, STATE_TAG):
        if key not in config:
            raise ValueError(f"the round's config has no {key!r}: was it sent by a fedopt_kernels.flower strategy?")
    if config["algorithm"] not in algorithm.VARIANTS:
        raise ValueError(f"algorithm must be one of {tuple(algorithm.VARIANTS)}, got {config['algorithm']!r}")
    cfg = FLConfig(algorithm=config["algorithm"])
    names = set(cfg.hparams())
    cfg = FLConfig(**{f: config[f] for f in _FIELDS if f in config and f not in names})
    hp = {k: config.get(k) for k in names}
    t = config[ROUND_INDEX]
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(f"{ROUND_INDEX} must be an integer >= 0, got {t!r}")
    return cfg, hp, t, str(config[STATE_TAG])
