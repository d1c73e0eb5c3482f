"""The state_dict format (docs/algorithms.md, "Bad input"; docs/torch_optim.md).

A ``state_dict`` is torch's, plus the round counters under ``ROUND_KEY`` (top level, and in every
param group, since ``torch.distributed.checkpoint`` keeps only ``state`` and ``param_groups``): the
round index, the within-round step count and the optimizer class that saved it. Loading refuses a
state_dict of another optimizer class before anything changes (``check_foreign``), and keeps the
float32 state of low-precision parameters in float32, where torch would cast it to the parameter's
dtype (``set_aside``). ``FedOptimizer.state_dict`` / ``load_state_dict`` use these.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

ROUND_KEY = "fedopt_round"


def round_entry(state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The saved round counters: top level, or (torch.distributed.checkpoint) in the param groups."""
    rnd = state_dict.get(ROUND_KEY)
    if rnd is None and state_dict.get("param_groups"):
        rnd = state_dict["param_groups"][0].get(ROUND_KEY)
    return rnd


def with_round(sd: Dict[str, Any], entry: Dict[str, Any]) -> Dict[str, Any]:
    """torch's ``sd`` with the round counters ``entry``, top level and in every param group."""
    sd[ROUND_KEY] = entry
    for group in sd["param_groups"]:  # torch.distributed.checkpoint keeps only state and param_groups
        group[ROUND_KEY] = dict(entry)
    return sd


def check_foreign(
    state_dict: Dict[str, Any], me: str, hp_names: Sequence[str], state_keys: Sequence[str]
) -> Dict[str, Any]:
    """Refuse a state_dict of another optimizer class than ``me`` (docs/algorithms.md) before anything
    is loaded: its round entry, its groups' hyperparameters ``hp_names``, its state keys within
    ``state_keys``. Returns the round entry."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{me}.load_state_dict needs an optimizer state_dict (with 'state' and 'param_groups')")
    rnd = round_entry(state_dict)
    if rnd is None:
        raise ValueError(f"state_dict has no '{ROUND_KEY}' entry; it was not saved by a fedopt_kernels optimizer")
    saved = rnd.get("optimizer")
    if saved is not None and saved != me:
        raise ValueError(f"state_dict was saved by {saved}, not {me}; load it into a {saved}")
    want = set(hp_names)
    for gi, group in enumerate(state_dict["param_groups"]):
        missing = want - set(group)
        if missing:
            raise ValueError(
                f"param group {gi} of the state_dict lacks {sorted(missing)}: it was saved by "
                f"another optimizer than {me}"
            )
    for pid, st in state_dict["state"].items():
        extra = set(st) - set(state_keys) if isinstance(st, dict) else set()
        if extra:
            raise ValueError(
                f"state of parameter {pid} has keys {sorted(extra)} that {me} does not keep "
                f"(its state keys: {list(state_keys)}): it was saved by another optimizer"
            )
    return rnd


def set_aside(
    state_dict: Dict[str, Any], float32_state: Sequence[str]
) -> Tuple[Dict[str, Any], Dict[Any, Dict[str, torch.Tensor]]]:
    """(what torch's ``load_state_dict`` is given: ``state_dict`` without the round entry and the
    ``float32_state`` keys; those keys' tensors per saved parameter id). torch casts every floating
    state tensor to its parameter's dtype on load: the keys kept in float32 are loaded apart."""
    kept: Dict[Any, Dict[str, torch.Tensor]] = {}
    state = {}
    for pid, st in state_dict["state"].items():
        if isinstance(st, dict):
            kept[pid] = {k: v for k, v in st.items() if k in float32_state}
            st = {k: v for k, v in st.items() if k not in float32_state}
        state[pid] = st
    sd = {k: v for k, v in state_dict.items() if k != ROUND_KEY}
    sd["state"] = state
    sd["param_groups"] = [{k: v for k, v in g.items() if k != ROUND_KEY} for g in state_dict["param_groups"]]
    return sd, kept
