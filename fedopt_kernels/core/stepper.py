"""One optimizer's steps: its plan, gathered and reused, the within-round step count, the launch and
its replay, the other ops a step runs (docs/dispatch.md, "The cached step plan").

A ``FedOptimizer`` owns one ``FedStepper``, which owns the optimizer's ``Capture`` (``capture.py``). The
stepper reads its owner through ``Owner``: the param groups and state, and the hooks an algorithm
overrides (docs/dispatch.md's table); it never imports the optimizer. A step checks its cached plan
(``plan.py``) and rebuilds it only when something it depends on changed, then launches the op through
``plan.fn``, the implementation ``core/registry.py``'s ``resolve`` picked for the op and backend:
for ``reference``, the op's function in ``core/reference.py``, which runs its math in
``fedopt_kernels.functional``. On a GPU the launch is replayed from a recording when its inputs are
the recorded ones (``replay.py``). Nothing here synchronises with the host once the plan is steady.

The step count ``k`` has three forms: ``k``, the device tensor the kernels read and advance (made at
the first step, authoritative from then on); ``k_host``, its value until then (0 after a round
start, a ``state_dict``'s after a load; client-batched: one per client); ``k_bound``, the step calls
of this round (and steps a caller's graph replayed), an upper bound of ``k`` that sizes the decay
table without reading the device.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple, Type

import torch
from torch._C import _set_grad_enabled

from . import replay as _replay
from .capture import Capture
from .op_runner import OpRunner, OtherOp
from .ops import OpSpec
from .plan import HpCache, StepPlan, capturing, refuse_in_capture
from .plan_inputs import GroupInputs, Member, PlanInputs
from .schedules import DecaySchedule

_COUNTS = ("eager", "recorded", "replayed", "wasted")

# (parameter, its group, its state entry, its flat index) -> (role tensors, hp overrides, extra present bits)
TensorsOf = Callable[
    [torch.Tensor, Dict[str, Any], Dict[str, Any], int], Tuple[Dict[str, torch.Tensor], Dict[str, float], int]
]


class Owner(Protocol):
    """What a stepper reads of the optimizer that owns it (``FedOptimizer``; the hooks' contracts are
    docs/dispatch.md's)."""

    param_groups: List[Dict[str, Any]]
    state: Any
    backend: str
    _spec: OpSpec
    _other_ops: Tuple[OtherOp, ...]
    _params_flat: List[torch.Tensor]

    def _validate_group(self, group: Dict[str, Any]) -> None: ...
    def _structure(self, group: Dict[str, Any]) -> tuple: ...
    def _group_rows(self, group: Dict[str, Any]) -> Tuple[tuple, Any, Optional[Tuple[float, ...]]]: ...
    def _step_tensors(
        self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]: ...
    def _extra_present(self, tensors: Dict[str, torch.Tensor]) -> int: ...
    def _step_roles(self) -> Tuple[str, ...]: ...
    def _schedule(self) -> Optional[DecaySchedule]: ...
    def _active_for(self, device: torch.device) -> Optional[torch.Tensor]: ...
    def _clients(self) -> Optional[int]: ...
    def _new_counter(self, device: torch.device) -> torch.Tensor: ...
    def _check_grad(self, p: torch.Tensor, g: torch.Tensor, idx: int) -> None: ...
    def _check_no_overlap(self) -> None: ...
    def _name_of(self, idx: int, params: Optional[List[torch.Tensor]] = None) -> str: ...


def amp_tensor(name: str, t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """GradScaler's tensor as the kernels take it (float32), or TypeError/ValueError naming it."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor with one element (from torch.amp.GradScaler)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the parameters are on {device}")
    return t if t.dtype == torch.float32 else t.float()


class FedStepper:
    """The plan, the step count, the replay and the other ops of one optimizer (``owner``)."""

    def __init__(self, owner: Owner, replay_on: bool):
        self.owner = owner
        self.replay_on = replay_on
        self.k: Optional[torch.Tensor] = None  # int32 [1] (client-batched: [C]) on the parameters' device
        self.k_host: Any = 0
        self.k_bound = 0
        self.capture = Capture()
        self.plan_cls: Type[StepPlan] = StepPlan  # dtensor.ShardedPlan when the parameters are DTensors
        self._fresh()

    def _fresh(self) -> None:
        """The caches: rebuilt, never copied."""
        self.plan: Optional[StepPlan] = None
        self.prologue: Optional[_replay.Prologue] = None  # work the next launch runs first (FedSAM's restore)
        self.ones: Dict[torch.device, torch.Tensor] = {}
        self.hp_cache = HpCache()  # the last hp rows and their device copy, shared by rebuilt plans
        self.replay: Optional[_replay.StepReplay] = _replay.StepReplay() if self.replay_on else None
        self.runners: Dict[str, OpRunner] = {}
        for op in self.owner._other_ops:
            if op.name in self.runners:
                raise ValueError(f"{type(self.owner).__name__} declares two other ops called {op.name!r}")
            self.runners[op.name] = OpRunner(op, self.replay_on)

    # ---------------------------------------------------------------- copies
    def __getstate__(self) -> Dict[str, Any]:
        keep = ("owner", "replay_on", "k", "k_host", "k_bound", "capture", "plan_cls")
        return {name: self.__dict__[name] for name in keep}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    def reload(self) -> None:
        """New state tensors (``load_state_dict`` on a live optimizer): the plans and recordings that
        read the old ones go; the replay counts and switches stay."""
        self.retire_graph()
        self.plan = self.prologue = None
        self.ones, self.hp_cache = {}, HpCache()
        for rep in [self.replay] + [r.replay for r in self.runners.values()]:
            if rep is not None:
                rep.forget()
        for runner in self.runners.values():
            runner.plan, runner.hp = None, HpCache()

    # ---------------------------------------------------------------- rounds and plans
    def start_round(self) -> None:
        """k back to 0, on the host and the device; a graph's plan retired."""
        self.retire_graph()
        self.k_host = 0
        self.k_bound = 0
        if self.k is not None:
            self.k.zero_()

    def drop_plan(self) -> None:
        """The step's tensors changed (new param groups, state or scales): a graph's plan is retired and
        the next step builds a plan."""
        self.retire_graph()
        self.plan = None

    def retire_graph(self) -> None:
        if self.capture.retire():
            self.hp_cache = HpCache()

    def counter(self, device: torch.device) -> torch.Tensor:
        """The device step count ``k``, made on ``device`` (from the host's) where it is not there."""
        k = self.k
        if k is None or k.device != device:
            refuse_in_capture(device, "create its step counter on the device")
            k = self.k = self.owner._new_counter(device)
        return k

    def one(self, device: torch.device) -> torch.Tensor:
        """A float64 ``[1.0]`` on ``device``: the schedule table of an op without a schedule."""
        t = self.ones.get(device)
        if t is None:
            t = self.ones[device] = torch.ones(1, dtype=torch.float64, device=device)
        return t

    # ---------------------------------------------------------------- gathering
    def group_inputs(self, indexes: Sequence[int]) -> Dict[int, GroupInputs]:
        """The plan's record of each group in ``indexes``: all of them validated before any is built."""
        owner = self.owner
        groups = owner.param_groups
        for gi in indexes:
            owner._validate_group(groups[gi])
        out = {}
        for gi in indexes:
            group = groups[gi]
            keys = tuple(k for k in group if k != "params")
            rows, lr_factor, lr_scale = owner._group_rows(group)
            lr = group["lr"]
            out[gi] = GroupInputs(
                group,
                keys,
                tuple(group[k] for k in keys),
                owner._structure(group),
                rows,
                lr if isinstance(lr, torch.Tensor) else None,
                lr_factor,
                lr_scale,
            )
        return out

    def plan_inputs(self) -> PlanInputs:
        """What the step plan is built from, gathered with the owner's hooks. Creates the state
        tensors this step needs (momentum buffers) and checks every gradient, naming the parameter."""
        owner = self.owner
        spec = owner._spec
        self.plan_cls.refuse(spec, type(owner).__name__)
        groups = self.group_inputs(range(len(owner.param_groups)))
        step_tensors, extra_present = owner._step_tensors, owner._extra_present

        def tensors_of(p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int):
            tensors, override = step_tensors(p, group, state, idx)
            return tensors, override, extra_present(tensors)

        return self.gather(spec, groups, tensors_of, owner._step_roles(), self.hp_cache)

    def gather(
        self, spec: OpSpec, groups: Dict[int, GroupInputs], tensors_of: TensorsOf, step_roles: Tuple[str, ...], hp: Any
    ) -> PlanInputs:
        """``spec``'s plan inputs: ``groups`` (every param group's record) and, for each parameter with
        a gradient, ``tensors_of(p, group, state, idx)``; one loop, so that every op's parameters are
        checked and named in errors alike. A state entry is kept only where ``tensors_of`` put
        something in it (torch keeps no empty entries)."""
        owner = self.owner
        name = type(owner).__name__
        members: List[Member] = []
        device: Optional[torch.device] = None
        idx = -1
        for gi, group in enumerate(owner.param_groups):
            for p in group["params"]:
                idx += 1
                g = p.grad
                if g is None:
                    continue
                owner._check_grad(p, g, idx)
                if device is None:
                    device = p.device
                elif p.device != device:
                    raise RuntimeError(
                        f"{owner._name_of(idx)} is on {p.device} but other parameters are on {device}; "
                        f"{name} needs all parameters on one device"
                    )
                st = owner.state.get(p)  # an entry is made only for state the step creates
                fresh = st is None
                if st is None:
                    st = {}
                tensors, override, extra = tensors_of(p, group, st, idx)
                if fresh and st:
                    owner.state[p] = st
                members.append(Member(idx, gi, tensors, override, extra))
        owner._check_no_overlap()
        params = owner._params_flat
        if device is None:
            device = params[0].device if params else torch.device("cpu")
        return PlanInputs(
            spec,
            owner.backend,
            name,
            params,
            tuple(groups.values()),
            tuple(members),
            device,
            step_roles,
            owner._clients(),
            hp,
        )

    # ---------------------------------------------------------------- the step
    def run(
        self,
        params_given: Optional[List[torch.Tensor]],
        per_step: Mapping[str, Sequence[Optional[torch.Tensor]]],
        grad_scale: Optional[torch.Tensor],
        found_inf: Optional[torch.Tensor],
    ) -> None:
        """One step of the owner's op. ``params_given``: tensors to write instead of the parameters (the
        compiled path); ``per_step``: role -> one tensor per parameter (validated by the owner)."""
        owner = self.owner
        plan = self.plan
        verdict = False if plan is None else plan.still_valid(owner.param_groups)
        if plan is None or (
            verdict is not True and (verdict is False or not plan.update_groups(self.group_inputs(verdict)))
        ):
            if self.capture.plan is not None:
                self.retire_graph()
            plan = self.plan = None  # a failed rebuild must not leave the old plan behind
            plan = self.plan = self.plan_cls(self.plan_inputs())
        if not plan.params:
            return  # no parameter has a gradient: as in torch.optim, nothing changes (k included)
        if plan.tensor_lrs:
            plan.load_lrs()
        device = plan.device
        if grad_scale is not None:
            grad_scale = amp_tensor("grad_scale", grad_scale, device)
        if found_inf is not None:
            found_inf = amp_tensor("found_inf", found_inf, device)
        k = self.k
        if k is None or k.device != device:
            k = self.counter(device)
        sched = owner._schedule()
        capture = capturing(device)  # a CUDA graph of the caller's is being captured
        if capture:
            self.capture.enter(owner, plan, sched, device, self.k_bound)
        table: Optional[torch.Tensor]
        if sched is not None:
            table, every = sched.table(device, self.k_bound), sched.decay_every
        else:
            table, every = self.ones.get(device), 1  # read here: a call less a step
        if table is None:
            table = self.one(device)
        active = owner._active_for(device) if owner._spec.batched else None
        rep = self.replay
        ok = plan.replayable  # decided once per plan (replay.replayable): never where steps are not recorded
        if ok is None:
            ok = plan.replayable = plan.device.type in _replay.DEVICE_TYPES and _replay.replayable(plan)
        if rep is not None and (params_given is not None or not ok or capture):
            rep = None  # this step runs eagerly (docs/replay.md)
        elif rep is not None and rep.off_reason is not None:
            rep.stats["eager"] += 1  # replay is off for good: no key to build, no AMP buffers to fill
            rep = None
        key = None
        pro = self.prologue
        if rep is not None:
            # GradScaler's new tensors each step: their values go into buffers a graph reads
            if grad_scale is not None or found_inf is not None:
                grad_scale, found_inf = rep.amp_buffers(device, grad_scale, found_inf)
            per_step_lists: List[List[Any]] = (
                [[per_param[i] for i in plan.step_order[r]] for r, per_param in per_step.items()] if per_step else []
            )
            key = rep.key(
                plan,
                per_step_lists,
                plan.hp,
                k,
                table,
                every,
                (grad_scale is not None, found_inf is not None),
                active,
                None if pro is None else pro.key,
            )
            if rep.replay(key):  # docs/replay.md: the recorded launch, bitwise the eager step
                self.prologue = None  # it was recorded with the launch
                self.k_bound += 1
                return
        lists: Dict[str, Any] = plan.lists
        if per_step:
            lists = dict(lists)
            for role, per_param in per_step.items():
                lists[role] = [per_param[i] for i in plan.step_order[role]]
        params: List[Any] = plan.params
        cache: Optional[Dict[str, Any]] = plan.cache
        if params_given is not None and params_given is not owner._params_flat:
            params = [params_given[i] for i in plan.order]
            if any(a is not b for a, b in zip(params, plan.params, strict=True)):
                cache = None  # copies of the parameters: per-tensor caches would point at the originals
        if cache is not None and type(plan) is StepPlan:
            cache["grad_set"] = plan.grad_set  # the backend's own key of the gradients' addresses
        # plan.fn: the backend's kernel for this op (reference: its function in core/reference.py, which
        # calls fedopt_kernels.functional); a ShardedPlan wraps it
        args = plan.args(params, lists, k, table, every, grad_scale, found_inf, active)
        if pro is not None:
            self.prologue = None  # it runs first in the launch below (so a recording holds it)
        if key is None:
            if pro is not None:
                pro.run()
            plan.fn(*args, cache=cache)
        elif pro is None:  # eager or recorded: bitwise the same step
            rep.launch(key, device, lambda: plan.fn(*args, cache=cache), cache)  # type: ignore[union-attr]
        else:

            def launch() -> None:
                pro.run()
                plan.fn(*args, cache=cache)

            rep.launch(key, device, launch, cache)  # type: ignore[union-attr]
        self.k_bound += 1

    # ---------------------------------------------------------------- other ops
    def run_op(self, name: str, active: Optional[torch.Tensor], per_step: Mapping[str, Any]) -> StepPlan:
        """Run other op ``name`` once over every parameter with a gradient (``FedOptimizer._run_op``)."""
        runner = self.runners.get(name)
        owner = self.owner
        if runner is None:
            raise KeyError(f"{type(owner).__name__} declares no other op {name!r} (its: {list(self.runners)})")
        op = runner.op
        if (per_step or op.step_roles) and sorted(per_step) != sorted(op.step_roles):
            raise TypeError(f"op {name!r} takes per-step roles {sorted(op.step_roles)}, got {sorted(per_step)}")
        plan = runner.current(
            owner.param_groups,
            lambda indexes: self.op_groups(op, indexes),
            lambda: self.plan_cls(self.op_inputs(op, runner)),
        )
        if plan.params:
            device = plan.device
            inputs = self.check_op_inputs(name, plan, per_step) if per_step else per_step
            one = self.ones.get(device)
            if one is None:
                one = self.one(device)
            grad = torch.is_grad_enabled()
            if grad:  # the op writes parameters in place: outside autograd, as a step runs its own
                _set_grad_enabled(False)
            try:
                runner.launch(plan, runner.counter(device, owner._clients()), one, active, inputs)
            finally:
                if grad:
                    _set_grad_enabled(True)
        return plan

    def op_groups(self, op: OtherOp, indexes: Iterable[int]) -> Dict[int, GroupInputs]:
        """Op ``op``'s record of each group in ``indexes``: all of them validated first (by the
        owner's ``_validate_group``); every client gets the same row."""
        owner = self.owner
        groups = owner.param_groups
        indexes = list(indexes)
        for gi in indexes:
            owner._validate_group(groups[gi])
        rows = owner._clients() or 1
        out = {}
        for gi in indexes:
            group = groups[gi]
            keys = tuple(k for k in group if k != "params")
            out[gi] = GroupInputs(group, keys, tuple(group[k] for k in keys), (), (op.row(group),) * rows)
        return out

    def op_inputs(self, op: OtherOp, runner: OpRunner) -> PlanInputs:
        """Op ``op``'s plan inputs: each parameter with a gradient and its state-fed role tensors
        (made on first use), a step role marked present for each of them."""
        spec = op.spec_for(self.owner._clients())
        self.plan_cls.refuse(spec, type(self.owner).__name__)
        groups = self.op_groups(op, range(len(self.owner.param_groups)))

        def tensors_of(p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int):
            tensors = op.state_tensors(p, state)
            for role in op.step_roles:
                tensors[role] = p  # a placeholder: the plan takes the launch's tensors for step roles
            return tensors, {}, 0

        return self.gather(spec, groups, tensors_of, op.step_roles, runner.hp)

    def check_op_inputs(
        self, name: str, plan: StepPlan, per_step: Mapping[str, Sequence[Optional[torch.Tensor]]]
    ) -> Dict[str, List[Optional[torch.Tensor]]]:
        """Each per-step role list: one tensor per parameter, shaped, typed and placed like it where
        the parameter has a gradient (None elsewhere is allowed)."""
        params = self.owner._params_flat
        name_of = self.owner._name_of
        out = {}
        for role, tensors in per_step.items():
            if not isinstance(tensors, (list, tuple)) or len(tensors) != len(params):
                raise TypeError(f"{role} of op {name!r} must be a list with one tensor per parameter ({len(params)})")
            r = plan.spec.role(role)
            for i in plan.order:
                t, p = tensors[i], params[i]
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{role} of op {name!r} has no tensor for {name_of(i)}, which has a gradient")
                shape = t.shape if r.per_row else p.shape  # one value per row: the op checks its length
                if t.shape != shape or t.dtype != r.dtype_for(p) or t.device != p.device:
                    raise ValueError(
                        f"{role} of op {name!r} for {name_of(i)}: {tuple(t.shape)} {t.dtype} on {t.device}, "
                        f"expected {tuple(shape)} {r.dtype_for(p)} on {p.device}"
                    )
            out[role] = list(tensors)
        return out

    # ---------------------------------------------------------------- steps a caller captures
    def reinstate_plan(self, plan: StepPlan) -> None:
        """``FedOptimizer.reinstate_plan``: ``plan`` is the step's plan again, its hp rows rewritten in
        place from the current param groups; a graph reads it."""
        groups = self.group_inputs(range(len(self.owner.param_groups)))
        host = plan.hp_rows([groups[gi] for gi in range(len(groups))])
        plan.hp.copy_(host)
        self.plan = plan
        self.capture.plan = plan  # a graph reads it: a later round start retires it until reinstated again
        self.hp_cache.keep(host, plan.hp)

    def reinstate_op(self, name: str, plan: StepPlan) -> None:
        """``reinstate_plan`` for other op ``name``'s plan."""
        runner = self.runners[name]
        groups = self.op_groups(runner.op, range(len(self.owner.param_groups)))
        host = plan.hp_rows([groups[gi] for gi in range(len(groups))])
        plan.hp.copy_(host)
        runner.hp.keep(host, plan.hp)
        runner.plan = plan

    def step_plans(self) -> Tuple[Any, ...]:
        """``FedOptimizer.step_plans``: the other ops' plans in their declared order, then the step's."""
        plan = self.plan
        if plan is None:
            return ()
        others = tuple(self.runners[op.name].plan for op in self.owner._other_ops)
        return () if any(p is None for p in others) else others + (plan,)

    def reinstate_plans(self, plans: Sequence[Any]) -> None:
        for op, plan in zip(self.owner._other_ops, plans, strict=False):
            self.reinstate_op(op.name, plan)
        self.reinstate_plan(plans[-1])

    def replay_stats(self) -> Dict[str, Any]:
        """``FedOptimizer.replay_stats``: the step's launches and its other ops', counted together."""
        rep = self.replay
        if rep is None:
            return {
                "on": False,
                "off_reason": "replay=False or FEDOPT_REPLAY=0",
                "eager": 0,
                "recorded": 0,
                "replayed": 0,
                "wasted": 0,
                "recordings": 0,
            }
        out: Dict[str, Any] = {
            "on": rep.off_reason is None,
            "off_reason": rep.off_reason,
            **rep.stats,
            "recordings": len(rep.recordings),
        }
        for runner in self.runners.values():
            other = runner.replay
            if other is None:
                continue
            for key in _COUNTS:
                out[key] += other.stats[key]
            out["recordings"] += len(other.recordings)
            if out["off_reason"] is None and other.off_reason is not None:
                out["on"], out["off_reason"] = False, other.off_reason
        return out
