"""``FedOptimizer``: the base of every optimizer of the package (docs/dispatch.md, "Extending FedOptimizer").

``FedOptimizer`` is the ``torch.optim`` face: param groups and their checks, the hooks an algorithm
overrides, the round API (``start_round``), ``step()``, ``state_dict`` and copies. It owns a
``FedStepper`` (``stepper.py``: the cached plan, the within-round step count, the launch and its
replay, the other ops a step runs), which owns a ``Capture`` (``capture.py``: a CUDA graph of the
caller's). A subclass names its op (``_spec``, from ``ops.py``), validates its hyperparameters
(``_validate_group``), turns a param group into its row of the op's ``hp`` tensor (``_hp_columns``
or ``_hp_row``), says which state tensors a parameter's step needs (``_step_tensors``) and, when its
step runs a second op, declares it (``_other_ops``) and calls ``_run_op``.
"""

from __future__ import annotations

import functools
from itertools import chain
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch._C import _set_grad_enabled
from torch.autograd import profiler
from torch.optim import Optimizer
from torch.optim import optimizer as _torch_optimizer

from . import dtensor as _dtensor
from . import plan_inputs
from . import registry as _registry
from . import replay as _replay
from . import step_op as _step_op
from .checks import (
    check_backend_runs,
    check_lr_tensor,
    check_new_params,
    check_no_overlap,
    check_number,
    check_tensor_list,
    normalized_group,
)
from .op_runner import OtherOp
from .ops import OpSpec, state_dtype
from .plan import StepPlan
from .plan_inputs import Column, check_grad, name_of
from .replay import Prologue, replayable, tensors_id
from .schedules import DecaySchedule
from .state_format import ROUND_KEY, check_foreign, round_entry, set_aside, with_round
from .stepper import FedStepper

__all__ = [
    "FedOptimizer",
    "OtherOp",
    "Prologue",
    "ROUND_KEY",
    "StepPlan",
    "check_lr_tensor",
    "check_number",
    "check_tensor_list",
    "replayable",
    "round_entry",
    "state_dtype",
    "tensors_id",
]

_NO_STEP_INPUTS: Dict[str, List[Optional[torch.Tensor]]] = {}  # never written: shared by every step


class FedOptimizer(Optimizer):
    """Base class: an optimizer with the FL round API of docs/algorithms.md and a pluggable backend.

    A subclass sets the class attributes and overrides the ``_``-prefixed hooks listed, each with
    its contract, in docs/dispatch.md ("Extending FedOptimizer: its hooks"); nothing else.
    """

    # ---------------------------------------------------------------- what a subclass sets
    _spec: OpSpec  # required: the op step() runs
    _round_state: Tuple[str, ...] = ()  # per-parameter state cleared by start_round(reset_state=True)
    _accepts_correction: bool = True
    _float32_state: Tuple[str, ...] = ()  # state kept in float32 (float64 for float64 params)
    _state_keys: Tuple[str, ...] = ("x0", "correction")  # every per-parameter state key this class keeps
    _step_input: Optional[str] = None  # name of the per-step tensor-list argument of step(), if any
    # torch.amp.GradScaler hands grad_scale / found_inf to step(): unscaling happens inside the kernels
    _step_supports_amp_scaling = True
    # op hp column -> what fills it where that is not the group's value of the column's name
    _hp_columns: Mapping[str, Column] = {}
    _other_ops: Tuple[OtherOp, ...] = ()  # the ops a step runs besides _spec (stepper.py)

    # ---------------------------------------------------------------- the base's own state
    backend: str
    _stepper: FedStepper
    _t: int  # index of the current round (-1: no round started yet)
    _params_flat: List[torch.Tensor]
    _handle: int  # step_op's handle of this optimizer's eager step
    _hp_names: Tuple[str, ...]  # what a state_dict's param groups must carry to be ours
    _lr_checked: List[torch.Tensor]  # tensor lrs whose value was validated (by identity)

    def __init__(
        self, params: Iterable, defaults: Dict[str, Any], backend: str = "auto", replay: Optional[bool] = None
    ):
        if not isinstance(backend, str) or (backend != "auto" and backend not in _registry.BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {_registry.BACKENDS}, got {backend!r}")
        self.backend = backend
        self._stepper = FedStepper(self, _replay.resolve_switch(replay))  # docs/replay.md
        self._t = -1
        self._params_flat = []
        self._handle = _step_op.register(self._run)
        # round_decay is optional in a loaded state_dict: saved before the classes took it, it is 1
        self._hp_names = tuple(k for k in defaults if k != "round_decay")
        self._lr_checked = []
        super().__init__(params, defaults)

    @classmethod
    def op_spec(cls) -> OpSpec:
        """The op this optimizer's step runs (its declaration in ``core/ops.py``)."""
        return cls._spec

    # ---------------------------------------------------------------- hooks: hyperparameters
    def _validate_group(self, group: Dict[str, Any]) -> None:
        """Raise ValueError naming the hyperparameter that is out of range (subclasses extend)."""
        if isinstance(group["lr"], torch.Tensor):
            self._check_lr(group, read_value=None)
        else:
            check_number("lr", group["lr"], low=0.0)
        if "prox_mu" in group:
            check_number("prox_mu", group["prox_mu"], low=0.0)
        if "round_decay" in group:
            check_number("round_decay", group["round_decay"], low=0.0, high=1.0, low_open=True)

    def _check_lr(self, group: Dict[str, Any], read_value: Optional[bool]) -> None:
        """Check a group's tensor lr. Its value is read when ``read_value``; when None (inside
        ``step()``), only for a tensor object not seen before that lives on the CPU: reading a device
        tensor would wait for the device. A tensor changed in place is never re-read (as in torch)."""
        lr = group["lr"]
        params = group["params"]
        seen = any(t is lr for t in self._lr_checked)
        if read_value is None:
            read_value = not seen and lr.device.type == "cpu"
        check_lr_tensor(lr, params[0].device if params else None, read_value=read_value)
        if not seen:
            live = [g["lr"] for g in self.param_groups if isinstance(g["lr"], torch.Tensor)]
            self._lr_checked = [t for t in self._lr_checked if any(t is x for x in live)] + [lr]

    def _structure(self, group: Dict[str, Any]) -> tuple:
        """The hyperparameter facts that decide which tensors a step needs (a change rebuilds the plan)."""
        return (group.get("prox_mu", 0.0) != 0.0,)

    def _hp_row(self, group: Dict[str, Any], t: Optional[int] = None) -> List[float]:
        """This group's row of the op's hp tensor, in ``_spec.hps`` order, for round ``t`` (default:
        the current round), before the round decay: ``_hp_columns``' values (``plan_inputs.row``)."""
        return plan_inputs.row(self._spec, self._hp_columns, group)

    def _lr_factor(self, group: Dict[str, Any], t: Optional[int] = None) -> float:
        """The round decay: what the learning rate is multiplied by in round ``t`` (default: the
        current round), ``round_decay ** t`` (1 for a group without ``round_decay``)."""
        decay = group.get("round_decay", 1.0)
        return 1.0 if decay == 1.0 else decay ** max(self._t if t is None else t, 0)

    def _row_of(self, group: Dict[str, Any], t: Optional[int] = None) -> List[float]:
        """The hp row the op reads in round ``t``: ``_hp_row`` with its learning-rate column (the op's
        declared ``lr``) times ``_lr_factor``, ``lr * round_decay ** t`` in float64 on the host. A
        tensor lr is not read: its column is 0 here and filled on the device (``plan.py``)."""
        lr = group["lr"]
        tensor_lr = isinstance(lr, torch.Tensor)
        row = self._hp_row(dict(group, lr=0.0) if tensor_lr else group, t)
        col = self._spec.lr_column
        if col is not None and not tensor_lr:
            f = self._lr_factor(group, t)
            if f != 1.0:
                row[col] = lr * f
        return row

    def _group_rows(self, group: Dict[str, Any]) -> Tuple[tuple, Any, Optional[Tuple[float, ...]]]:
        """A validated group's (hp rows, one per client; the factor on a tensor lr, None for exactly 1;
        per-client lr scales or None): ``GroupInputs``' fields (client-batched forms override)."""
        f = self._lr_factor(group) if isinstance(group["lr"], torch.Tensor) else 1.0
        return (tuple(self._row_of(group)),), (None if f == 1.0 else f), None

    # ---------------------------------------------------------------- hooks: rounds and steps
    def _check_round_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        """Validate the algorithm's own start_round inputs; return them normalised (subclasses)."""
        if inputs:
            raise TypeError(f"{type(self).__name__}.start_round() got unexpected inputs {sorted(inputs)}")
        return {}

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        """Store the validated per-round inputs in the state (subclasses)."""

    def _step_tensors(
        self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
        """Optional-role tensors of ``p`` for its step, and per-tensor hp overrides (subclasses extend).

        Parameters with the same roles and overrides in one group share a row group (an hp row).
        """
        out = {}
        if group.get("prox_mu", 0.0) != 0.0:
            if "x0" not in state:
                if self._t >= 0:
                    gi = self.param_groups.index(group)
                    raise RuntimeError(
                        f"prox_mu of param group {gi} was set after start_round(); the FedProx "
                        f"anchor x0 is taken at start_round(), so call start_round() again"
                    )
            else:
                out["x0"] = state["x0"]
        if "correction" in state:
            out["correction"] = state["correction"]
        return out, {}

    def _extra_present(self, tensors: Dict[str, torch.Tensor]) -> int:
        """Bits of a row group's ``present`` mask beyond its roles (the batched SGD's FRESH)."""
        return 0

    def _step_roles(self) -> Tuple[str, ...]:
        """Optional roles fed from ``step()``'s per-step input rather than from the state."""
        return ()

    def _check_step_inputs(self, value: Any) -> Dict[str, List[Optional[torch.Tensor]]]:
        """Validate ``step(<_step_input>=value)``: role -> one tensor (or None) per parameter (subclasses)."""
        return {}

    def _schedule(self) -> Optional[DecaySchedule]:
        """The within-round decay schedule (``schedules.py``), or None."""
        return None

    # ---------------------------------------------------------------- hooks of the client-batched mixin
    def _active_for(self, device: torch.device) -> Optional[torch.Tensor]:
        """The active-client mask a client-batched op reads (the mixin's); per-client ops take none."""
        return None

    def _clients(self) -> Optional[int]:
        """Clients of a client-batched optimizer (hp rows per client); None for a per-client one."""
        return None

    def _new_counter(self, device: torch.device) -> torch.Tensor:
        """A device step count ``k`` holding ``round_step`` (int32 ``[1]``; client-batched: ``[C]``)."""
        return torch.full((1,), self.round_step, dtype=torch.int32, device=device)

    # ---------------------------------------------------------------- what a subclass calls
    def _run_op(self, name: str, *, active: Optional[torch.Tensor] = None, **per_step: Any) -> StepPlan:
        """Run other op ``name`` (declared in ``_other_ops``) once over every parameter with a gradient;
        returns its plan (the flat indexes it ran over are ``plan.order``). ``active``: the client
        mask of a client-batched op; ``per_step``: role -> one tensor per parameter for each of the
        op's ``step_roles``."""
        return self._stepper.run_op(name, active, per_step)

    def _op_plan(self, name: str) -> Optional[StepPlan]:
        """Other op ``name``'s current plan (None before its first run)."""
        return self._stepper.runners[name].plan

    def _run_after(self, prologue: Optional[Prologue]) -> None:
        """A step of the optimizer's own op whose launch runs ``prologue`` first, in the same recording
        (FedSAM's restore before its descent); run anyway when the step launches nothing (no
        gradient now, or a refused step)."""
        stepper = self._stepper
        stepper.prologue = prologue
        try:
            stepper.run(None, _NO_STEP_INPUTS, None, None)
        finally:
            pro = stepper.prologue
            if pro is not None:
                stepper.prologue = None
                pro.run()

    def _drop_plan(self) -> None:
        """The tensors a step reads changed outside ``start_round`` (new neuron scales, the end of a
        FedDyn round): the next step builds its plan anew."""
        self._stepper.drop_plan()

    def _k(self) -> Any:
        """k as the kernels hold it, without a host sync: the device step count once a step made it,
        else its host value (an int; client-batched: a list)."""
        stepper = self._stepper
        return stepper.k if stepper.k is not None else stepper.k_host

    def _k_bound(self) -> int:
        """The step calls since ``start_round`` (and steps a caller's graph replayed): at least ``k``."""
        return self._stepper.k_bound

    def _opaque(self, run: Callable[..., None]) -> Callable[[], None]:
        """``run`` (a bound method taking ``(params, step_inputs, grad_scale, found_inf)``) as one opaque
        op over the parameters, which is what torch.compile sees of a step (``step_op.py``)."""
        handle = _step_op.register(run)

        def opaque() -> None:
            params = self._params_flat
            _step_op.OP(params, [p.grad for p in params], [], None, None, handle)

        return opaque

    # ---------------------------------------------------------------- param groups
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's ``add_param_group``, validated before anything changes (a rejected group adds nothing)."""
        group = normalized_group(param_group, self.defaults, len(self.param_groups))
        self._check_new_params(group["params"], len(self.param_groups))
        if isinstance(group["lr"], torch.Tensor):
            self._check_lr(group, read_value=True)  # outside step(): the value is checked once, here
        sharded = _dtensor.check_params(self._name_of, list(self._params_flat) + group["params"])
        self._validate_group(group)
        super().add_param_group(group)
        self._params_flat = [p for g in self.param_groups for p in g["params"]]
        self._stepper.plan_cls = _dtensor.plan_class(sharded)
        self._stepper.drop_plan()

    def _check_new_params(self, params: List[torch.Tensor], gi: int) -> None:
        """Refuse parameters a fused step could not update as the reference does (``checks.py``)."""
        check_new_params(params, self._params_flat, type(self).__name__, gi)
        self._check_no_overlap(list(self._params_flat) + list(params))
        check_backend_runs(self.backend, self._spec.name, params, gi)

    def _check_no_overlap(self, params: Optional[List[torch.Tensor]] = None) -> None:
        """Refuse parameters that share memory (overlapping views of one storage)."""
        check_no_overlap(self._params_flat if params is None else params, self._name_of)

    @property
    def sharded(self) -> bool:
        """True when the parameters are DTensors: each step then runs ``dtensor.ShardedPlan``."""
        return self._stepper.plan_cls is not StepPlan

    def _name_of(self, idx: int, params: Optional[List[torch.Tensor]] = None) -> str:
        """How errors name flat parameter ``idx`` (built only when raising)."""
        return name_of(self.param_groups, idx, self._params_flat if params is None else params)

    def _check_grad(self, p: torch.Tensor, g: torch.Tensor, idx: int) -> None:
        check_grad(p, g, idx, self.param_groups, self._params_flat, type(self).__name__)

    # ---------------------------------------------------------------- rounds
    @property
    def round_index(self) -> int:
        """t: the number of start_round calls so far, minus one."""
        return self._t

    @property
    def round_step(self) -> int:
        """k: the number of steps taken since the last start_round (reads the device count)."""
        k = self._stepper.k
        return int(k.reshape(-1)[0]) if k is not None else self._stepper.k_host

    @torch.no_grad()
    def start_round(
        self,
        *,
        reset_state: bool = True,
        correction: Optional[Sequence[torch.Tensor]] = None,
        round_index: Any = None,
        **inputs: Any,
    ) -> None:
        """Begin local training on a freshly received global model (docs/algorithms.md).

        Resets the within-round step count, clears per-round state (momentum buffers, ...)
        unless ``reset_state=False``, snapshots the FedProx anchor ``x0`` for groups with
        ``prox_mu > 0``, and stores the SCAFFOLD ``correction`` (``c - c_i``, one tensor per
        parameter in param-group order) that is added to every gradient of the round.
        ``round_index``: the index t of the round this one is (default: the one after the last);
        one optimizer can then train client after client, each at the global round.
        """
        if round_index is not None and (
            isinstance(round_index, bool) or not isinstance(round_index, int) or round_index < 0
        ):
            raise ValueError(f"round_index must be an integer >= 0, got {round_index!r}")
        params = self._params_flat
        if correction is not None:
            if not self._accepts_correction:
                raise TypeError(f"{type(self).__name__}.start_round() takes no 'correction'")
            correction = check_tensor_list("correction", correction, params, self._name_of)
        inputs = self._check_round_inputs(inputs)
        stepper = self._stepper
        stepper.capture.check_round(stepper.k, self._t, type(self).__name__)
        # everything validated: from here on nothing raises
        stepper.start_round()
        self._t = self._t + 1 if round_index is None else round_index
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)  # never create an empty entry (torch keeps none)
                if st is not None:
                    if reset_state:
                        for key in self._round_state:
                            st.pop(key, None)
                    st.pop("correction", None)
                    st.pop("x0", None)
                    if not st:
                        del self.state[p]
                if group.get("prox_mu", 0.0) != 0.0:
                    self.state[p]["x0"] = p.detach().clone(memory_format=torch.preserve_format)
        if correction is not None:
            for p, c in zip(params, correction, strict=True):
                self.state[p]["correction"] = c.detach().to(dtype=p.dtype).clone()
        self._apply_round_inputs(inputs)
        stepper.plan = None

    # ---------------------------------------------------------------- the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's ``zero_grad``. With ``set_to_none`` (the default), outside a profiler and
        torch.compile, the gradients are dropped in a plain loop: torch's enters its profiler range
        and checks each gradient first, several times the cost, in every iteration of a loop."""
        if not set_to_none or profiling() or torch.compiler.is_compiling():
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
            cls.step = hooked_step(cls.step)  # type: ignore[method-assign]

    def step(  # type: ignore[override]  # per-step input keywords beyond torch's closure
        self, closure: Optional[Callable[[], float]] = None, **step_inputs: Any
    ) -> Optional[float]:
        """One local step (torch.optim semantics). Starts a round first if none was started.

        Under ``torch.amp.GradScaler`` the scaler's ``grad_scale`` / ``found_inf`` are used inside
        the kernels: gradients are unscaled on the fly, and a step with an inf/NaN gradient leaves
        parameters, state and the step count unchanged, with no host synchronisation.
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
        if self._t < 0:
            self.start_round()
        if self._step_input is None:
            per_step = _NO_STEP_INPUTS  # step() refused any: nothing to check (a call less per step)
        else:
            extra = step_inputs.get(self._step_input)
            per_step = self._check_step_inputs(None if isinstance(extra, (list, tuple)) and not extra else extra)
        # what torch.no_grad() does, without the decorator's few microseconds of host time a step
        if torch.is_grad_enabled():
            _set_grad_enabled(False)
            try:
                self._stepper.run(None, per_step, grad_scale, found_inf)
            finally:
                _set_grad_enabled(True)
        else:
            self._stepper.run(None, per_step, grad_scale, found_inf)
        return loss

    def _per_step(self, step_input: Any) -> Dict[str, List[Optional[torch.Tensor]]]:
        """``step(<_step_input>=step_input)`` validated: role -> one tensor (or None) per parameter."""
        if isinstance(step_input, (list, tuple)) and len(step_input) == 0:
            step_input = None
        return self._check_step_inputs(step_input)

    def _run(
        self,
        params_given: Optional[List[torch.Tensor]],
        step_input: Any,
        grad_scale: Optional[torch.Tensor],
        found_inf: Optional[torch.Tensor],
    ) -> None:
        """The body of ``fedopt::optimizer_step`` (``step_op.py``): the eager step, writing
        ``params_given`` (the tensors torch.compile hands over) instead of the parameters."""
        if self._t < 0:
            self.start_round()
        per_step = _NO_STEP_INPUTS if self._step_input is None else self._per_step(step_input)
        self._stepper.run(params_given, per_step, grad_scale, found_inf)

    def resolved_backend(self) -> str:
        """The backend ``step()`` uses for this optimizer's parameters (resolving ``"auto"``)."""
        params = self._params_flat
        device = params[0].device if params else torch.device("cpu")
        return _registry.auto_backend(device, self._spec.name) if self.backend == "auto" else self.backend

    # ---------------------------------------------------------------- captures
    def prepare_capture(self, steps_per_round: int) -> None:
        """Ready what a CUDA graph holding ``step()`` reads for the first ``steps_per_round`` steps of
        a round. A graph's replays advance the within-round step count ``k`` on the device without
        the optimizer seeing them, so a table the kernels index by ``k`` must be complete before the
        capture: FedDecaySGD's ``s(k // decay_every)`` is tabulated here for every ``k <
        steps_per_round`` (the other optimizers read no such table). A capture that needs it and
        was not prepared is refused (docs/replay.md, "A whole iteration in one graph")."""
        self._stepper.capture.prepare(steps_per_round, self._schedule(), self._params_flat)

    @property
    def step_plan(self) -> Optional[StepPlan]:
        """The plan the next step runs: None before the first step and after anything that drops it
        (a round start, a new param group, ``load_state_dict``)."""
        return self._stepper.plan

    def reinstate_plan(self, plan: StepPlan) -> None:
        """Make ``plan`` (this optimizer's, kept by a captured graph) the step's plan again, its
        hyperparameter rows rewritten in place from the current param groups: a graph reading
        ``plan.hp`` then sees this round's values."""
        self._stepper.reinstate_plan(plan)

    @property
    def step_plans(self) -> Tuple[Any, ...]:
        """Everything the next step launches through a ``fn`` attribute, in launch order: the plans of
        ``_other_ops`` in their declared order, then its own plan; none until each was built.
        FedSAM's: its ascent's plan, its restore (a ``Prologue``), its descent's plan."""
        return self._stepper.step_plans()

    def reinstate_plans(self, plans: Sequence[Any]) -> None:
        """``reinstate_plan`` for what ``step_plans`` returned (a captured step's launches): the first
        plans are the other ops', in order, the last the step's own."""
        self._stepper.reinstate_plans(plans)

    def note_replayed_steps(self, n: int = 1) -> None:
        """Count ``n`` steps a replay took without ``step()``: the host-side count that sizes the
        decay table and that PAdaMFed's ``local_control`` checks."""
        self._stepper.k_bound += n

    def replay_stats(self) -> Dict[str, Any]:
        """How this optimizer's steps ran on a GPU (docs/replay.md): ``eager``, ``recorded`` (a CUDA
        graph made, and replayed for that step), ``replayed`` and ``wasted`` (recordings dropped
        without a replay) launch counts, ``recordings`` held now, and ``on`` / ``off_reason``. The
        launches of ``_other_ops`` count too (a FedSAM step replayed whole counts 2 in ``replayed``)."""
        return self._stepper.replay_stats()

    # ---------------------------------------------------------------- state_dict
    def state_dict(self) -> Dict[str, Any]:
        entry = {"t": self._t, "k": self.round_step, "optimizer": type(self).__name__}
        return with_round(super().state_dict(), entry)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        rnd = check_foreign(state_dict, type(self).__name__, self._hp_names, self._state_keys)
        # strict=False: torch's load_state_dict below refuses another number of groups, with its message
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=False):
            lr = saved.get("lr") if isinstance(saved, dict) else None
            if isinstance(lr, torch.Tensor):  # outside step(): its value is checked here, once
                check_lr_tensor(lr, group["params"][0].device if group["params"] else None, read_value=True)
        _dtensor.check_loadable(self.sharded, self._name_of, state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        sd, kept = set_aside(state_dict, self._float32_state)
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
        stepper = self._stepper
        k = rnd["k"]  # one count, or one per client (client-batched optimizers)
        if isinstance(k, (list, tuple)):
            stepper.k_host = [int(v) for v in k]
            stepper.k_bound = max(stepper.k_host, default=0)
        else:
            stepper.k_host = stepper.k_bound = int(k)
        stepper.k = None
        stepper.plan = None

    # ---------------------------------------------------------------- copies
    def __getstate__(self) -> Dict[str, Any]:
        # torch's Optimizer keeps only defaults/state/param_groups; the round counters, the backend
        # choice and the schedule are part of what continues a round, so they travel too (the
        # stepper drops its caches itself); the compile handle is this object's own
        return {k: v for k, v in self.__dict__.items() if k != "_handle"}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        # torch's load_state_dict calls this on a live optimizer, with the new state and param groups
        live = "_stepper" in self.__dict__ and "_stepper" not in state
        super().__setstate__(state)
        self.__dict__.setdefault("_lr_checked", [])
        if "round_decay" in self.defaults:  # a state_dict saved before the class took round_decay
            for group in self.param_groups:
                group.setdefault("round_decay", 1.0)
        if live:
            self._stepper.reload()
        self._handle = _step_op.register(self._run)
        self._params_flat = [p for g in self.param_groups for p in g["params"]]


# ---------------------------------------------------------------- torch.optim's step hooks
# torch.optim wraps ``step`` so that it enters a ``record_function`` range named
# ``Optimizer.step#<Class>.step`` and runs the global and per-optimizer pre and post hooks. Entering
# the range costs a dispatcher call even when no profiler records, a few microseconds of host time
# per step, which is most of a replayed step (docs/replay.md). ``hooked_step`` runs the same hooks in
# the same order and enters the same range, but only while a profiler is running.
def hooked_step(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` (a class's ``step``) wrapped with torch.optim's hooks and profiler range."""

    @functools.wraps(func)
    def step(self, *args: Any, **kwargs: Any) -> Any:
        if profiler._is_profiler_enabled:
            with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
                return _with_hooks(func, self, args, kwargs)
        return _with_hooks(func, self, args, kwargs)

    step.hooked = True  # type: ignore[attr-defined]
    return step


def profiling() -> bool:
    """Is a torch profiler recording (then torch's own ranges are entered)?"""
    return bool(profiler._is_profiler_enabled)


def _with_hooks(func: Callable[..., Any], self: Any, args: tuple, kwargs: dict) -> Any:
    pre = self._optimizer_step_pre_hooks
    if pre or _torch_optimizer._global_optimizer_pre_hooks:
        full = (self,) + args
        for hook in chain(_torch_optimizer._global_optimizer_pre_hooks.values(), pre.values()):
            result = hook(self, full, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{func} must return None or a tuple of (new_args, new_kwargs), but got {result}."
                    )
                full, kwargs = result
        args = tuple(full[1:])
    out = func(self, *args, **kwargs)
    self._optimizer_step_code()
    post = self._optimizer_step_post_hooks
    if post or _torch_optimizer._global_optimizer_post_hooks:
        full = (self,) + args
        for hook in chain(post.values(), _torch_optimizer._global_optimizer_post_hooks.values()):
            hook(self, full, kwargs)
    return out
