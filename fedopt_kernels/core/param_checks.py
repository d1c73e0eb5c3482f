"""Parameters and param groups, checked where they are given (docs/algorithms.md, "Bad input").

A param group is normalised as torch.optim does (a tensor, a list, ``(name, tensor)`` pairs) and
refused, naming the parameter, when a fused step could not update it as the reference does:
complex or integer tensors, the same tensor twice, views that overlap, a backend named explicitly
that cannot run on the parameters' device. A rejected ``add_param_group`` adds nothing.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import dtensor as _dtensor
from . import registry as _registry
from .caller_graph import CallerGraph
from .checks import extent
from .plan import StepPlan
from .plan_inputs import check_grad, name_of, param_name

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ParamChecks(CallerGraph):
    """``add_param_group`` validated before anything changes, and how errors name a parameter."""

    def _normalized_group(self, param_group: Dict[str, Any]) -> Dict[str, Any]:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("param_group has no 'params'")
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the "
                "ordering of tensors in sets will change between runs. Please use a list instead."
            )
        else:
            params = list(params)
        group = dict(param_group)
        named = [isinstance(p, tuple) for p in params]
        if any(named):  # (name, tensor) pairs, e.g. model.named_parameters(): torch.optim keeps the names
            if not all(named):
                raise ValueError("all optimizer params should be with/without names. Some param names are missing")
            gi = len(self.param_groups)
            for pi, item in enumerate(params):
                if len(item) != 2 or not isinstance(item[0], str):
                    raise TypeError(
                        f"named parameter {pi} of param group {gi} must be a (name, tensor) pair with "
                        f"a str name, got {item!r:.80}"
                    )
            group["param_names"] = [name for name, _ in params]
            params = [p for _, p in params]
        group["params"] = params
        for name, default in self.defaults.items():
            group.setdefault(name, default)
        return group

    def _check_new_params(self, params: List[torch.Tensor], gi: int) -> None:
        seen = {id(p) for p in self._params_flat}
        for pi, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"{type(self).__name__} can only optimize Tensors, but parameter {pi} of param "
                    f"group {gi} is a {type(p).__name__}"
                )
            if p.is_complex():
                raise TypeError(
                    f"{param_name(gi, pi, p)} is complex; {type(self).__name__} supports real parameters only"
                )
            if p.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"{param_name(gi, pi, p)} has dtype {p.dtype}; supported: {_FLOAT_DTYPES}")
            if id(p) in seen:
                raise ValueError(
                    f"{param_name(gi, pi, p)} is given twice (the same tensor in one or two param "
                    f"groups); a fused step would update it once where the reference updates it twice"
                )
            seen.add(id(p))
        self._check_no_overlap(list(self._params_flat) + list(params))
        self._check_backend_runs(params, gi)

    def _check_backend_runs(self, params: List[torch.Tensor], gi: int) -> None:
        """A backend named explicitly must run these parameters: refused here, where it is named,
        not at the first ``step()`` (``auto`` picks one that runs)."""
        if self.backend == "auto":
            return
        checked = set()
        for pi, p in enumerate(params):
            if p.device in checked:
                continue
            checked.add(p.device)
            why = _registry.unavailable_reason(self.backend, p.device, self._spec.name)
            if why is not None:
                # a backend that runs elsewhere: the parameters' device is what to change
                hint = (
                    " (move the model before building the optimizer)"
                    if _registry.unavailable_reason(self.backend, None, self._spec.name) is None
                    else ""
                )
                raise ValueError(
                    f"backend={self.backend!r} cannot run {param_name(gi, pi, p)}, on {p.device}: "
                    f"{why}; use backend='auto' or a backend that runs there{hint}"
                )

    def _check_no_overlap(self, params: Optional[List[torch.Tensor]] = None) -> None:
        """Refuse parameters that share memory (overlapping views of one storage)."""
        params = self._params_flat if params is None else params
        by_storage: Dict[int, List[Tuple[int, int, int]]] = {}
        for i, p in enumerate(params):
            ext = extent(p)
            if ext is None:
                continue
            spans = by_storage.setdefault(ext[0], [])
            for lo, hi, j in spans:
                if ext[1] < hi and lo < ext[2]:
                    raise ValueError(
                        f"{self._name_of(j, params)} and {self._name_of(i, params)} share memory "
                        f"(overlapping views of one storage); each parameter must own its memory"
                    )
            spans.append((ext[1], ext[2], i))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's ``add_param_group``, validated before anything changes (a rejected group adds nothing)."""
        group = self._normalized_group(param_group)
        self._check_new_params(group["params"], len(self.param_groups))
        if isinstance(group["lr"], torch.Tensor):
            self._check_lr(group, read_value=True)  # outside step(): the value is checked once, here
        sharded = _dtensor.check_params(self._name_of, list(self._params_flat) + group["params"])
        self._validate_group(group)
        super().add_param_group(group)
        self._params_flat = [p for g in self.param_groups for p in g["params"]]
        self._plan_cls = _dtensor.plan_class(sharded)
        self._retire_graph()
        self._plan = None

    @property
    def sharded(self) -> bool:
        """True when the parameters are DTensors: each step then runs ``dtensor.ShardedPlan``."""
        return self._plan_cls is not StepPlan

    def _name_of(self, idx: int, params: Optional[List[torch.Tensor]] = None) -> str:
        """How errors name flat parameter ``idx`` (built only when raising)."""
        return name_of(self.param_groups, idx, self._params_flat if params is None else params)

    def _check_grad(self, p: torch.Tensor, g: torch.Tensor, idx: int) -> None:
        check_grad(p, g, idx, self.param_groups, self._params_flat, type(self).__name__)
