"""The hooks' results gathered into a step plan's inputs (docs/dispatch.md, "The cached step plan").

``PlanGather`` runs the optimizer's hooks (validation, hp rows, state tensors) and hands their
results to a plan as plain data (``plan_inputs.PlanInputs``), so that the plan never calls back
into the optimizer. One loop over the parameters serves the optimizer's own op (``_plan_inputs``)
and every other op its step runs (``other_ops.py``): each parameter with a gradient is checked
and named in errors the same way, whatever op it feeds.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .ops import OpSpec
from .param_checks import ParamChecks
from .plan_inputs import GroupInputs, Member, PlanInputs

# (parameter, its group, its state entry, its flat index) -> (role tensors, hp overrides, extra present bits)
TensorsOf = Callable[
    [torch.Tensor, Dict[str, Any], Dict[str, Any], int], Tuple[Dict[str, torch.Tensor], Dict[str, float], int]
]


class PlanGather(ParamChecks):
    """What a plan is built from: each param group's record and each parameter's tensors."""

    def _row_of(self, group: Dict[str, Any], t: Optional[int] = None) -> List[float]:
        """``_hp_row`` without reading a tensor lr (its column is filled on the device, ``plan.py``)."""
        if isinstance(group["lr"], torch.Tensor):
            group = dict(group, lr=0.0)
        return self._hp_row(group, t)

    def _group_rows(self, group: Dict[str, Any]) -> Tuple[tuple, Any, Optional[Tuple[float, ...]]]:
        """A validated group's (hp rows, one per client; the factor on a tensor lr, None for exactly 1;
        per-client lr scales or None): ``GroupInputs``' fields (client-batched forms override)."""
        f = self._lr_factor(group) if isinstance(group["lr"], torch.Tensor) else 1.0
        return (tuple(self._row_of(group)),), (None if f == 1.0 else f), None

    def _group_inputs(self, indexes: Sequence[int]) -> Dict[int, GroupInputs]:
        """The plan's record of each group in ``indexes``: all of them validated before any is built."""
        groups = self.param_groups
        for gi in indexes:
            self._validate_group(groups[gi])
        out = {}
        for gi in indexes:
            group = groups[gi]
            keys = tuple(k for k in group if k != "params")
            rows, factor, scale = self._group_rows(group)
            lr = group["lr"]
            out[gi] = GroupInputs(
                group,
                keys,
                tuple(group[k] for k in keys),
                self._structure(group),
                rows,
                lr if isinstance(lr, torch.Tensor) else None,
                factor,
                scale,
            )
        return out

    def _plan_inputs(self) -> PlanInputs:
        """What the step plan is built from, gathered with this class's hooks. Creates the state
        tensors this step needs (momentum buffers) and checks every gradient, naming the parameter."""
        spec = self._spec
        self._plan_cls.refuse(spec, type(self).__name__)
        groups = self._group_inputs(range(len(self.param_groups)))
        return self._gather(spec, groups, self._member_tensors, self._step_roles(), self._hp_cache)

    def _member_tensors(
        self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float], int]:
        """A parameter's tensors for the optimizer's own op: the ``_step_tensors`` and
        ``_extra_present`` hooks."""
        tensors, override = self._step_tensors(p, group, state, idx)
        return tensors, override, self._extra_present(tensors)

    def _gather(
        self,
        spec: OpSpec,
        groups: Dict[int, GroupInputs],
        tensors_of: TensorsOf,
        step_roles: Tuple[str, ...],
        hp_cache: Any,
    ) -> PlanInputs:
        """``spec``'s plan inputs: ``groups`` (every param group's record) and, for each parameter with
        a gradient, ``tensors_of(p, group, state, idx)``. A state entry is kept only where
        ``tensors_of`` put something in it (torch keeps no empty entries)."""
        owner = type(self).__name__
        members: List[Member] = []
        device: Optional[torch.device] = None
        idx = -1
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                idx += 1
                g = p.grad
                if g is None:
                    continue
                self._check_grad(p, g, idx)
                if device is None:
                    device = p.device
                elif p.device != device:
                    raise RuntimeError(
                        f"{self._name_of(idx)} is on {p.device} but other parameters are on {device}; "
                        f"{owner} needs all parameters on one device"
                    )
                st = self.state.get(p)  # an entry is made only for state the step creates
                fresh = st is None
                if st is None:
                    st = {}
                tensors, override, extra = tensors_of(p, group, st, idx)
                if fresh and st:
                    self.state[p] = st
                members.append(Member(idx, gi, tensors, override, extra))
        self._check_no_overlap()
        params = self._params_flat
        if device is None:
            device = params[0].device if params else torch.device("cpu")
        return PlanInputs(
            spec,
            self.backend,
            owner,
            params,
            tuple(groups.values()),
            tuple(members),
            device,
            step_roles,
            self._clients(),
            hp_cache,
        )
