"""``step()``: the cached plan, the device counters, GradScaler's tensors and the launch (docs/dispatch.md).

A step checks its cached plan (``plan.py``) and rebuilds it only when something it depends on
changed, then launches the op through ``plan.fn``, the implementation ``core/registry.py``'s
``resolve`` picked for the op and backend (``core/impl_table.py``: ``reference/``,
``backends/cpu.py``, ``cuda.py``, ``triton.py``; a ``ShardedPlan`` wraps it). On a GPU the launch
is replayed from a recording when its inputs are the recorded ones (``replay.py``). Nothing here
synchronises with the host once the plan is steady. Under ``torch.compile`` a step is one opaque
op (``step_op.py``) whose body is this same ``_run``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch._C import _set_grad_enabled

from . import registry as _registry
from . import step_hooks as _step_hooks
from . import step_op as _step_op
from .plan import StepPlan, capturing, refuse_in_capture
from .replay import replayable
from .round_api import RoundAPI

_NO_STEP_INPUTS: Dict[str, List[Optional[torch.Tensor]]] = {}  # never written: shared by every step


class StepDispatch(RoundAPI):
    """``step()``, ``zero_grad()`` and what a launch reads: counters, the schedule table, AMP tensors."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's ``zero_grad``. With ``set_to_none`` (the default), outside a profiler and
        torch.compile, the gradients are dropped in a plain loop: torch's enters its profiler range
        and checks each gradient first, several times the cost, in every iteration of a loop."""
        if not set_to_none or _step_hooks.profiling() or torch.compiler.is_compiling():
            super().zero_grad(set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _patch_step_function(self) -> None:
        # torch.optim's hooks and profiler range, the range entered only while a profiler records
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"
        cls = type(self)
        if not getattr(cls.step, "hooked", None):
            cls.step = _step_hooks.hooked_step(cls.step)  # type: ignore[method-assign]

    def _counter(self, device: torch.device) -> torch.Tensor:
        k = self._k_dev
        if k is None or k.device != device:
            refuse_in_capture(device, "create its step counter on the device")
            value = self.round_step
            k = self._k_dev = torch.full((1,), value, dtype=torch.int32, device=device)
        return k

    def _one(self, device: torch.device) -> torch.Tensor:
        t = self._ones.get(device)
        if t is None:
            t = self._ones[device] = torch.ones(1, dtype=torch.float64, device=device)
        return t

    @staticmethod
    def _check_amp(name: str, t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """GradScaler's tensor as the kernels take it (float32), or TypeError/ValueError naming it."""
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor with one element (from torch.amp.GradScaler)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the parameters are on {device}")
        return t if t.dtype == torch.float32 else t.float()

    def step(  # type: ignore[override]  # per-step input keywords beyond torch's closure
        self, closure: Optional[Callable[[], float]] = None, **step_inputs: Any
    ) -> Optional[float]:
        """One local step (torch.optim semantics). Starts a round first if none was started.

        Under ``torch.amp.GradScaler`` the scaler's ``grad_scale`` / ``found_inf`` are used inside
        the kernels: gradients are unscaled on the fly, and a step with an inf/NaN gradient leaves
        parameters, state and the step counter unchanged, with no host synchronisation.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if torch.compiler.is_compiling():
            params = self._params_flat
            extra = step_inputs.get(self._step_input, None) if self._step_input else None
            with torch.no_grad():
                _step_op.OP(
                    params,
                    [p.grad for p in params],
                    [] if extra is None else list(extra),
                    grad_scale,
                    found_inf,
                    self._handle,
                )
            return loss
        if step_inputs and (self._step_input is None or set(step_inputs) != {self._step_input}):
            raise TypeError(f"{type(self).__name__}.step() got unexpected arguments {sorted(step_inputs)}")
        extra = step_inputs.get(self._step_input) if self._step_input else None
        # what torch.no_grad() does, without the decorator's few microseconds of host time a step
        if torch.is_grad_enabled():
            _set_grad_enabled(False)
            try:
                self._run(None, extra, grad_scale, found_inf)
            finally:
                _set_grad_enabled(True)
        else:
            self._run(None, extra, grad_scale, found_inf)
        return loss

    def _run(
        self,
        params_given: Optional[List[torch.Tensor]],
        step_input: Any,
        grad_scale: Optional[torch.Tensor],
        found_inf: Optional[torch.Tensor],
    ) -> None:
        """The eager step. ``params_given``: tensors to write instead of the parameters (compiled path)."""
        if self._t < 0:
            self.start_round()
        if self._step_input is None:
            per_step = _NO_STEP_INPUTS  # step() refused any: nothing to check (a call less per step)
        else:
            if isinstance(step_input, (list, tuple)) and len(step_input) == 0:
                step_input = None
            per_step = self._check_step_inputs(step_input)
        plan = self._plan
        verdict = False if plan is None else plan.still_valid(self.param_groups)
        if plan is None or (
            verdict is not True and (verdict is False or not plan.update_groups(self._group_inputs(verdict)))
        ):
            if self._graph_plan is not None:
                self._retire_graph()
            plan = self._plan = None  # a failed rebuild must not leave the old plan behind
            plan = self._plan = self._plan_cls(self._plan_inputs())
        if not plan.params:
            return  # no parameter has a gradient: as in torch.optim, nothing changes (k included)
        if plan.tensor_lrs:
            plan.load_lrs()
        device = plan.device
        if grad_scale is not None:
            grad_scale = self._check_amp("grad_scale", grad_scale, device)
        if found_inf is not None:
            found_inf = self._check_amp("found_inf", found_inf, device)
        k = self._k_dev
        if k is None or k.device != device:
            k = self._counter(device)
        sched = self._schedule()
        capture = capturing(device)  # a CUDA graph of the caller's is being captured
        if capture:
            self._enter_capture(plan, sched, device)
        if sched is not None:
            table, every = sched.table(device, self._host_steps), sched.decay_every
        else:
            table, every = self._one(device), 1
        spec = self._spec
        active = self._active_for(device) if spec.batched else None
        rep = self._replay
        ok = plan.replayable  # decided once per plan
        if ok is None:
            ok = replayable(plan)
        if rep is not None and (params_given is not None or not ok or capture):
            rep = None  # this step runs eagerly (docs/replay.md)
        elif rep is not None and rep.off_reason is not None:
            rep.stats["eager"] += 1  # replay is off for good: no key to build, no AMP buffers to fill
            rep = None
        key = None
        pro = self._prologue
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
                self._prologue = None  # it was recorded with the launch
                self._host_steps += 1
                return
        lists: Dict[str, Any] = plan.lists
        if per_step:
            lists = dict(lists)
            for role, per_param in per_step.items():
                lists[role] = [per_param[i] for i in plan.step_order[role]]
        params: List[Any] = plan.params
        cache: Optional[Dict[str, Any]] = plan.cache
        if params_given is not None and params_given is not self._params_flat:
            params = [params_given[i] for i in plan.order]
            if any(a is not b for a, b in zip(params, plan.params, strict=True)):
                cache = None  # copies of the parameters: per-tensor caches would point at the originals
        if cache is not None and type(plan) is StepPlan:
            cache["grad_set"] = plan.grad_set  # the backend's own key of the gradients' addresses
        # plan.fn: the backend's kernel for this op, as core/registry.py's resolve() picked it from
        # core/impl_table.py (reference/, backends/cpu.py, cuda.py, triton.py); ShardedPlan wraps it
        args = plan.args(params, lists, k, table, every, grad_scale, found_inf, active)
        if pro is not None:
            self._prologue = None  # it runs first in the launch below (so a recording holds it)
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
        self._host_steps += 1

    def resolved_backend(self) -> str:
        """The backend ``step()`` uses for this optimizer's parameters (resolving ``"auto"``)."""
        params = self._params_flat
        device = params[0].device if params else torch.device("cpu")
        return _registry.auto_backend(device, self._spec.name) if self.backend == "auto" else self.backend
