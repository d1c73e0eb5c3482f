"""The state_dict format and copies (docs/algorithms.md, "Bad input"; docs/torch_optim.md).

A ``state_dict`` is torch's, plus the round counters under ``ROUND_KEY`` (top level, and in every
param group, since ``torch.distributed.checkpoint`` keeps only ``state`` and ``param_groups``): the
round index, the within-round step count and the optimizer class that saved it. Loading refuses a
state_dict of another optimizer class before anything changes, and keeps the float32 state of
low-precision parameters in float32 (torch would cast it to the parameter's dtype). A copy
(``copy.deepcopy``, pickle) travels with the round counters and rebuilds its caches.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import dtensor as _dtensor
from . import replay as _replay
from . import step_op as _step_op
from .captured_steps import CapturedSteps
from .checks import check_lr_tensor
from .ops import state_dtype
from .plan import HpCache

ROUND_KEY = "fedopt_round"
# attributes rebuilt after a copy instead of copied: caches, the compile handle, other ops' runners
_TRANSIENT = (
    "_plan",
    "_handle",
    "_ones",
    "_hp_cache",
    "_replay",
    "_prologue",
    "_graph_plan",
    "_graph_cover",
    "_retired",
    "_runners",
)


def round_entry(state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The saved round counters: top level, or (torch.distributed.checkpoint) in the param groups."""
    rnd = state_dict.get(ROUND_KEY)
    if rnd is None and state_dict.get("param_groups"):
        rnd = state_dict["param_groups"][0].get(ROUND_KEY)
    return rnd


class StateFormat(CapturedSteps):
    """``state_dict`` / ``load_state_dict`` with the round counters, ``__getstate__`` / ``__setstate__``."""

    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd[ROUND_KEY] = {"t": self._t, "k": self.round_step, "optimizer": type(self).__name__}
        for group in sd["param_groups"]:  # torch.distributed.checkpoint keeps only state and param_groups
            group[ROUND_KEY] = dict(sd[ROUND_KEY])
        return sd

    def _check_foreign(self, state_dict: Dict[str, Any]) -> None:
        """Refuse a state_dict of another optimizer class (docs/algorithms.md) before anything is loaded."""
        me = type(self).__name__
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(f"{me}.load_state_dict needs an optimizer state_dict (with 'state' and 'param_groups')")
        rnd = round_entry(state_dict)
        if rnd is None:
            raise ValueError(f"state_dict has no '{ROUND_KEY}' entry; it was not saved by a fedopt_kernels optimizer")
        saved = rnd.get("optimizer")
        if saved is not None and saved != me:
            raise ValueError(f"state_dict was saved by {saved}, not {me}; load it into a {saved}")
        want = set(self._hp_names)
        for gi, group in enumerate(state_dict["param_groups"]):
            missing = want - set(group)
            if missing:
                raise ValueError(
                    f"param group {gi} of the state_dict lacks {sorted(missing)}: it was saved by "
                    f"another optimizer than {me}"
                )
        for pid, st in state_dict["state"].items():
            extra = set(st) - set(self._state_keys) if isinstance(st, dict) else set()
            if extra:
                raise ValueError(
                    f"state of parameter {pid} has keys {sorted(extra)} that {me} does not keep "
                    f"(its state keys: {list(self._state_keys)}): it was saved by another optimizer"
                )

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._check_foreign(state_dict)
        # strict=False: torch's load_state_dict below refuses another number of groups, with its message
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=False):
            lr = saved.get("lr") if isinstance(saved, dict) else None
            if isinstance(lr, torch.Tensor):  # outside step(): its value is checked here, once
                check_lr_tensor(lr, group["params"][0].device if group["params"] else None, read_value=True)
        _dtensor.check_loadable(self.sharded, self._name_of, state_dict)
        rnd = round_entry(state_dict)
        assert rnd is not None  # _check_foreign refused a state_dict without one
        # torch casts every floating state tensor to its parameter's dtype on load; the keys in
        # _float32_state are kept in float32 for low-precision parameters, so load them ourselves.
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        kept: Dict[Any, Dict[str, torch.Tensor]] = {}
        state = {}
        for pid, st in state_dict["state"].items():
            if isinstance(st, dict):
                kept[pid] = {k: v for k, v in st.items() if k in self._float32_state}
                st = {k: v for k, v in st.items() if k not in self._float32_state}
            state[pid] = st
        sd = {k: v for k, v in state_dict.items() if k != ROUND_KEY}
        sd["state"] = state
        sd["param_groups"] = [{k: v for k, v in g.items() if k != ROUND_KEY} for g in state_dict["param_groups"]]
        super().load_state_dict(sd)
        for p in [p for p, st in self.state.items() if isinstance(st, dict) and not st]:
            del self.state[p]  # empty entries of older state_dicts: torch keeps none
        self._lr_checked = [g["lr"] for g in self.param_groups if isinstance(g["lr"], torch.Tensor)]
        params = self._params_flat = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params, strict=True):
            for key, value in kept.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=state_dtype(p))
        if self.sharded:
            _dtensor.place_loaded_state(params, self.state, self._name_of)
        self._t = int(rnd["t"])
        k = rnd["k"]  # one counter, or one per client (client-batched optimizers)
        if isinstance(k, (list, tuple)):
            self._k_host = [int(v) for v in k]
            self._host_steps = max(self._k_host, default=0)
        else:
            self._k_host = self._host_steps = int(k)
        self._k_dev = None
        self._plan = None

    # ---------------------------------------------------------------- copies
    def __getstate__(self) -> Dict[str, Any]:
        # torch's Optimizer keeps only defaults/state/param_groups; the round counters, the backend
        # choice and the schedule are part of what continues a round, so they travel too
        return {k: v for k, v in self.__dict__.items() if k not in _TRANSIENT}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_lr_checked", [])
        if self.__dict__.get("_graph_plan") is not None:  # load_state_dict on a live optimizer: new state tensors
            self._retire_graph()
        for name, default in (("_graph_plan", None), ("_graph_cover", None), ("_retired", []), ("_capture_steps", 0)):
            self.__dict__.setdefault(name, default)
        self._plan = None
        self._prologue = None
        self._ones = {}
        self._hp_cache = HpCache()
        self._handle = _step_op.register(self._run)
        self._params_flat = [p for g in self.param_groups for p in g["params"]]
        self.__dict__.setdefault("_replay_on", _replay.default_on())
        rep = self.__dict__.get("_replay")
        if isinstance(rep, _replay.StepReplay):
            # load_state_dict on a live optimizer: its counts and off_reason stay, the recordings
            # (which read the old state tensors) go
            rep.forget()
        else:
            self._replay = _replay.StepReplay() if self._replay_on else None
        old = self.__dict__.get("_runners")
        self._runners = self._new_runners()
        if isinstance(old, dict):  # a live optimizer: its other ops' counts and off_reason stay, as its own
            for name, runner in old.items():
                if runner.replay is not None and name in self._runners:
                    runner.replay.forget()
                    self._runners[name].replay = runner.replay
