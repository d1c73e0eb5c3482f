"""A second op of an optimizer's step: its declaration (``OtherOp``) and what runs it (``OpRunner``).

An algorithm whose step runs another op besides its own (FedSAM: the ascent ``sam_ascent`` before
its ``sgd`` descent) declares it in its class, ``_other_ops = (OtherOp(...),)``: which op, the roles
it feeds and how a param group becomes its hp row. The optimizer's stepper (``stepper.py``) gathers
the op's plan inputs as it gathers its own op's, and this module's ``OpRunner`` keeps the op's plan,
hp rows, step counters and launch replay, as the base keeps its own op's: built once, reused while
nothing changes, so that an eager step allocates nothing on the device and a step at known
addresses replays its recording (docs/replay.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import plan_inputs
from . import replay as _replay
from .ops import OPS, OpSpec
from .plan import HpCache, StepPlan, capturing, refuse_in_capture
from .plan_inputs import Column, GroupInputs

_NO_AMP = (False, False)


@dataclass(frozen=True)
class OtherOp:
    """An op an optimizer's step runs besides its own (``_spec``), over the same parameters.

    ``name``: what the optimizer calls it by (``self._run_op(name)``); ``spec``: the per-client op
    (``core/ops.py``; a client-batched optimizer runs its ``<op>_batched`` form); ``state``:
    optional role -> the per-parameter state key that feeds it, made (zeros, in the role's dtype)
    where it is missing or no longer matches the parameter; ``step_roles``: optional roles given at
    each launch, ``self._run_op(name, role=[one tensor per parameter])``; ``columns``: its hp row
    (``plan_inputs.row``: by default column ``c`` holds the group's ``c``). Roles named in neither
    are absent. The op's step counter is its own and its schedule table is ``[1.0]``.
    """

    name: str
    spec: OpSpec
    state: Mapping[str, str] = field(default_factory=dict)
    step_roles: Tuple[str, ...] = ()
    columns: Mapping[str, Column] = field(default_factory=dict)

    def __post_init__(self) -> None:
        what = f"OtherOp {self.name!r}"
        if self.spec.batched:
            raise ValueError(f"{what}: give the per-client op, not {self.spec.name!r} (its batched form is found)")
        optional = {r.name for r in self.spec.optional}
        fed = list(self.state) + list(self.step_roles)
        unknown = sorted(set(fed) - optional)
        if unknown:
            raise ValueError(f"{what}: op {self.spec.name!r} has no optional roles {unknown} (its: {sorted(optional)})")
        if len(set(fed)) != len(fed):
            raise ValueError(f"{what}: a role is fed twice (state and step_roles): {fed}")
        per_row = sorted(r for r in self.state if self.spec.role(r).per_row)
        if per_row:
            raise ValueError(
                f"{what}: per-row roles {per_row} cannot be made from the parameter's shape: feed them per step"
            )
        plan_inputs.check_columns(self.spec, self.columns, what)

    def spec_for(self, clients: Optional[int]) -> OpSpec:
        """The op a per-client (``clients`` None) or client-batched optimizer runs."""
        return self.spec if clients is None else OPS[f"{self.spec.name}_batched"]

    def row(self, group: Dict[str, Any]) -> Tuple[float, ...]:
        """``group``'s row of this op's hp tensor."""
        return tuple(plan_inputs.row(self.spec, self.columns, group))

    def state_tensors(self, p: torch.Tensor, state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
        """``p``'s tensors of the state-fed roles, made in ``state`` where missing or stale."""
        out = {}
        for role, key in self.state.items():
            t = state.get(key)
            dtype = self.spec.role(role).dtype_for(p)
            if t is None or t.shape != p.shape or t.dtype != dtype or t.device != p.device:
                # zeros, not empty: an inactive client's slice is state too (deterministic bits)
                t = state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            out[role] = t
        return out


class OpRunner:
    """One ``OtherOp``'s plan, hp rows, counters and replay (the optimizer builds its plans)."""

    def __init__(self, op: OtherOp, replay_on: bool):
        self.op = op
        self.plan: Optional[StepPlan] = None
        self.hp = HpCache()
        self.k: Dict[torch.device, torch.Tensor] = {}  # the op's own counter (nothing reads it)
        self.replay: Optional[_replay.StepReplay] = _replay.StepReplay() if replay_on else None

    def current(
        self,
        groups: List[Dict[str, Any]],
        group_inputs: Callable[[List[int]], Dict[int, GroupInputs]],
        build: Callable[[], StepPlan],
    ) -> StepPlan:
        """The plan for this step: the last one while it serves (rows rewritten in place after an
        hp edit; ``group_inputs(indexes)``: the edited groups' ``GroupInputs``), else ``build()``'s,
        which keeps the last one's norm scratch."""
        plan = self.plan
        if plan is not None:
            verdict = plan.still_valid(groups)
            if verdict is True or (verdict is not False and plan.update_groups(group_inputs(verdict))):
                return plan
        self.plan = None  # a failed rebuild must not leave the old plan behind
        new = self.plan = build()
        if plan is not None and "scratch" in plan.cache:
            new.cache["scratch"] = plan.cache["scratch"]  # the backend reuses it when big enough
        return new

    def counter(self, device: torch.device, clients: Optional[int]) -> torch.Tensor:
        k = self.k.get(device)
        if k is None:
            refuse_in_capture(device, f"create the step counter of op {self.op.spec.name!r} on the device")
            k = self.k[device] = torch.zeros(clients or 1, dtype=torch.int32, device=device)
        return k

    def launch(
        self,
        plan: StepPlan,
        k: torch.Tensor,
        one: torch.Tensor,
        active: Optional[torch.Tensor],
        per_step: Mapping[str, Sequence[Optional[torch.Tensor]]],
    ) -> None:
        """The op over ``plan``: replayed, recorded or eager, as the optimizer's own op
        (``stepper.Stepper.run``). ``per_step``: role -> one tensor per parameter."""
        device = plan.device
        rep = self.replay
        ok = plan.replayable  # decided once per plan (replay.replayable): never where steps are not recorded
        if ok is None:
            ok = plan.replayable = plan.device.type in _replay.DEVICE_TYPES and _replay.replayable(plan)
        if rep is not None and (not ok or capturing(device)):
            rep = None
        elif rep is not None and rep.off_reason is not None:
            rep.stats["eager"] += 1
            rep = None
        given: Dict[str, List[Any]] = {r: [per[i] for i in plan.step_order[r]] for r, per in per_step.items()}
        key = None
        if rep is not None:
            key = rep.key(plan, list(given.values()), plan.hp, k, one, 1, _NO_AMP, active)
            if rep.replay(key):
                return
        cache = plan.cache
        if type(plan) is StepPlan:
            cache["grad_set"] = plan.grad_set  # the backend's own key of the gradients' addresses
        lists = {**plan.lists, **given} if given else plan.lists
        args = plan.args(plan.params, lists, k, one, 1, None, None, active)
        if key is None:
            plan.fn(*args, cache=cache)
        else:
            rep.launch(key, device, lambda: plan.fn(*args, cache=cache), cache)  # type: ignore[union-attr]
