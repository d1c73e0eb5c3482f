"""Another op a step runs over the optimizer's parameters: ``self._run_op(name)`` (docs/dispatch.md).

An algorithm declares the op in its class (``_other_ops = (OtherOp(name, spec, state=..., ...),)``,
``op_runner.py``) and calls ``self._run_op(name)`` where its step runs it: the base gathers the
op's plan inputs with the same loop and checks as its own op's (``gather.py``: every parameter
with a gradient, its state-fed role tensors, each param group's hp row from the declaration's
columns), builds the plan once and reuses it while nothing changes (rows rewritten in place after
an hp edit), and launches it, replayed on a GPU as its own op's launches are. FedSAM's ascent runs
this way before its ``sgd`` descent.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch
from torch._C import _set_grad_enabled

from .dispatch import StepDispatch
from .op_runner import OpRunner, OtherOp
from .plan import StepPlan
from .plan_inputs import GroupInputs, PlanInputs


class OtherOps(StepDispatch):
    """``_run_op``: the ops of ``_other_ops``, each with its own plan, counters and replay."""

    def _new_runners(self) -> Dict[str, OpRunner]:
        """A fresh ``OpRunner`` for each of ``_other_ops`` (no plan yet)."""
        runners = {}
        for op in self._other_ops:
            if op.name in runners:
                raise ValueError(f"{type(self).__name__} declares two other ops called {op.name!r}")
            runners[op.name] = OpRunner(op, self._replay_on)
        return runners

    def _run_op(self, name: str, *, active: Optional[torch.Tensor] = None, **per_step: Any) -> StepPlan:
        """Run other op ``name`` once over every parameter with a gradient; returns its plan (the
        flat indexes it ran over are ``plan.order``). ``active``: the client mask of a client-batched
        op; ``per_step``: role -> one tensor per parameter for each of the op's ``step_roles``."""
        runner = self._runners.get(name)
        if runner is None:
            raise KeyError(f"{type(self).__name__} declares no other op {name!r} (its: {list(self._runners)})")
        op = runner.op
        if (per_step or op.step_roles) and sorted(per_step) != sorted(op.step_roles):
            raise TypeError(f"op {name!r} takes per-step roles {sorted(op.step_roles)}, got {sorted(per_step)}")
        plan = runner.current(
            self.param_groups,
            lambda indexes: self._op_groups(op, indexes),
            lambda: self._plan_cls(self._op_inputs(op, runner)),
        )
        if plan.params:
            device = plan.device
            inputs = self._check_op_inputs(name, plan, per_step) if per_step else per_step
            grad = torch.is_grad_enabled()
            if grad:  # the op writes parameters in place: outside autograd, as step() runs its own
                _set_grad_enabled(False)
            try:
                runner.launch(plan, runner.counter(device, self._clients()), self._one(device), active, inputs)
            finally:
                if grad:
                    _set_grad_enabled(True)
        return plan

    def _op_plan(self, name: str) -> Optional[StepPlan]:
        """Other op ``name``'s current plan (None before its first run)."""
        return self._runners[name].plan

    def _reinstate_op(self, name: str, plan: StepPlan) -> None:
        """Make ``plan`` (other op ``name``'s, kept by a captured graph) its plan again, its hp rows
        rewritten in place from the current param groups (``captured_steps.py``)."""
        runner = self._runners[name]
        groups = self._op_groups(runner.op, range(len(self.param_groups)))
        host = plan.hp_rows([groups[gi] for gi in range(len(groups))])
        plan.hp.copy_(host)
        runner.hp.keep(host, plan.hp)
        runner.plan = plan

    def _op_groups(self, op: OtherOp, indexes: Iterable[int]) -> Dict[int, GroupInputs]:
        """Op ``op``'s record of each group in ``indexes``: all of them validated first (by the
        optimizer's ``_validate_group``); every client gets the same row."""
        groups = self.param_groups
        indexes = list(indexes)
        for gi in indexes:
            self._validate_group(groups[gi])
        rows = self._clients() or 1
        out = {}
        for gi in indexes:
            group = groups[gi]
            keys = tuple(k for k in group if k != "params")
            out[gi] = GroupInputs(group, keys, tuple(group[k] for k in keys), (), (op.row(group),) * rows)
        return out

    def _op_inputs(self, op: OtherOp, runner: OpRunner) -> PlanInputs:
        """Op ``op``'s plan inputs: each parameter with a gradient and its state-fed role tensors
        (made on first use), a step role marked present for each of them."""
        spec = op.spec_for(self._clients())
        self._plan_cls.refuse(spec, type(self).__name__)
        groups = self._op_groups(op, range(len(self.param_groups)))

        def tensors_of(p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int):
            tensors = op.state_tensors(p, state)
            for role in op.step_roles:
                tensors[role] = p  # a placeholder: the plan takes the launch's tensors for step roles
            return tensors, {}, 0

        return self._gather(spec, groups, tensors_of, op.step_roles, runner.hp)

    def _check_op_inputs(
        self, name: str, plan: StepPlan, per_step: Mapping[str, Sequence[Optional[torch.Tensor]]]
    ) -> Dict[str, List[Optional[torch.Tensor]]]:
        """Each per-step role list: one tensor per parameter, shaped, typed and placed like it where
        the parameter has a gradient (None elsewhere is allowed)."""
        params = self._params_flat
        out = {}
        for role, tensors in per_step.items():
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(params):
                raise TypeError(f"{role} of op {name!r} must be a list with one tensor per parameter ({len(params)})")
            r = plan.spec.role(role)
            for i in plan.order:
                t, p = tensors[i], params[i]
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{role} of op {name!r} has no tensor for {self._name_of(i)}, which has a gradient")
                shape = t.shape if r.per_row else p.shape  # one value per row: the op checks its length
                if t.shape != shape or t.dtype != r.dtype_for(p) or t.device != p.device:
                    raise ValueError(
                        f"{role} of op {name!r} for {self._name_of(i)}: {tuple(t.shape)} {t.dtype} on {t.device}, "
                        f"expected {tuple(shape)} {r.dtype_for(p)} on {p.device}"
                    )
            out[role] = list(tensors)
        return out
