"""A Flower app's run config (``[tool.flwr.app.config]``, ``flwr run --run-config``) as simulator configs.

Keys are ``SimConfig`` field names with hyphens (``local-steps``, ``holdout-fraction``, ...); a
value of ``"default"`` (or ``""``) means the simulator's default, which for ``lr``,
``server-lr``, ``beta``, ... is the algorithm's own default (as when a ``fedopt-sim`` flag is left
out). ``algorithm`` may list several algorithms separated by commas: the app runs them one after
the other on the same clients. Keys that are not ``SimConfig`` fields (``fraction-evaluate``,
``out``) are the app's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping

from ..sim.config import SimConfig

_DEFAULT = ("default", "")
_FIELDS = {f.name: f for f in dataclasses.fields(SimConfig) if f.name != "split"}


def sim_configs(run_config: Mapping[str, Any]) -> List[SimConfig]:
    """One validated SimConfig per algorithm named in ``run_config["algorithm"]``."""
    common = {}
    for name in _FIELDS:
        key = name.replace("_", "-")
        if name == "algorithm" or key not in run_config:
            continue
        value = run_config[key]
        if isinstance(value, str) and value.strip().lower() in _DEFAULT:
            continue  # the field's default
        common[name] = value
    algorithms = [a.strip() for a in str(run_config.get("algorithm", "fedavg")).split(",") if a.strip()]
    if not algorithms:
        raise ValueError("algorithm must name at least one algorithm, got an empty string")
    return [SimConfig(algorithm=a, **common).validate() for a in algorithms]
