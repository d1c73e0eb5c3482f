"""The round API (docs/algorithms.md) and backend dispatch shared by every optimizer of the package.

A subclass names its op (``_spec``, from ``ops.py``), validates its hyperparameters
(``_validate_group``), turns a param group into its row of the op's ``hp`` tensor (``_hp_row``)
and says which state tensors a parameter's step needs (``_step_tensors``). This class does the
rest: ``start_round``, FedProx anchors, SCAFFOLD corrections, the cached step plan (``plan.py``),
the device-side step counter, GradScaler's in-kernel unscaling, torch.compile (``step_op.py``),
``state_dict`` with the round counters, and copies (``copy.deepcopy``, pickle). The step plan is
built from what ``_plan_inputs`` gathers with these hooks (``plan_inputs.py``): the plan never
calls them itself.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type

import torch
from torch._C import _set_grad_enabled
from torch.optim import Optimizer

from . import dtensor as _dtensor
from . import registry as _registry
from . import replay as _replay
from . import step_hooks as _step_hooks
from . import step_op as _step_op
from .ops import OpSpec
from .plan import HpCache, StepPlan, capturing, refuse_in_capture
from .plan_inputs import GroupInputs, Member, PlanInputs, check_grad, name_of, param_name
from .schedules import DecaySchedule

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NO_STEP_INPUTS: Dict[str, List[Optional[torch.Tensor]]] = {}  # never written: shared by every step
ROUND_KEY = "fedopt_round"
# attributes rebuilt after a copy instead of copied: caches and the compile handle
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
)
# plans of retired graphs kept alive (with the tensors their graphs write), the most recent first
RETIRED_GRAPHS = 2


def check_number(
    name: str, value: Any, *, low: Optional[float] = None, high: Optional[float] = None, low_open: bool = False
) -> float:
    """Return ``float(value)`` or raise ValueError naming ``name`` when it is not a finite number in range."""
    if isinstance(value, torch.Tensor):
        # reading a CUDA tensor back would be a host sync inside step(); only lr has a sync-free path
        raise TypeError(f"{name} must be a Python number, got a tensor (only lr may be a tensor, as in torch.optim)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (v <= low if low_open else v < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    return v


def check_lr_tensor(lr: torch.Tensor, device: Optional[torch.device], *, read_value: bool) -> None:
    """Check a tensor learning rate (docs/torch_optim.md); its value only when ``read_value``.

    The value check reads the tensor back (a host sync for a device tensor), so the caller asks
    for it only outside ``step()`` or for CPU tensors.
    """
    if lr.numel() != 1:
        # torch.optim's wording first (its generic optimizer tests match it), then ours
        raise ValueError(
            f"Tensor lr must be 1-element: lr must be a number or a tensor with one element "
            f"(0-d), got a tensor of shape {tuple(lr.shape)}"
        )
    if not lr.is_floating_point() or lr.is_complex():
        # an integer tensor would truncate what a scheduler writes into it with fill_
        raise TypeError(f"lr tensor must have a real floating-point dtype, got {lr.dtype}")
    if lr.device.type != "cpu" and device is not None and lr.device != device:
        raise ValueError(f"lr tensor is on {lr.device}; it must be on the CPU or on the parameters' device ({device})")
    if read_value:
        v = float(lr.detach().reshape(()).double())
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"lr must be finite, got {v!r} (tensor)")
        if v < 0:
            raise ValueError(f"lr must be >= 0.0, got {v!r} (tensor)")


def check_tensor_list(
    name: str, tensors: Sequence[torch.Tensor], params: List[torch.Tensor], param_names: Callable[[int], str]
) -> List[torch.Tensor]:
    """Check a per-parameter list (controls, corrections) against the parameters; return it as a list."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, one per parameter, got {type(tensors).__name__}")
    if len(tensors) != len(params):
        raise ValueError(f"{name} has {len(tensors)} tensors but the optimizer has {len(params)} parameters")
    for i, (t, p) in enumerate(zip(tensors, params, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} entry for {param_names(i)} is {type(t).__name__}, not a tensor")
        if t.shape != p.shape:
            raise ValueError(f"{name} entry for {param_names(i)} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if t.device != p.device:
            raise ValueError(f"{name} entry for {param_names(i)} is on {t.device}, expected {p.device}")
        if t.is_complex() or t.is_sparse:
            raise TypeError(f"{name} entry for {param_names(i)} must be a dense real tensor")
        _dtensor.check_placed_like(name, t, p, param_names(i))
    return list(tensors)


def _extent(p: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """(storage address, first byte, end byte) that ``p`` may touch; None for zero-size tensors."""
    p = _dtensor.local(p)
    if p.numel() == 0:
        return None
    span = sum((s - 1) * abs(st) for s, st in zip(p.shape, p.stride(), strict=True))
    item = p.element_size()
    start = p.storage_offset() * item
    return p.untyped_storage().data_ptr(), int(start), int(start + (span + 1) * item)


class FedOptimizer(Optimizer):
    """Base class: an optimizer with the FL round API of docs/algorithms.md and a pluggable backend.

    A subclass sets the class attributes and overrides the ``_``-prefixed hooks listed, each with
    its contract, in docs/dispatch.md ("Extending FedOptimizer: its hooks"); nothing else.
    """

    _spec: OpSpec
    _round_state: Tuple[str, ...] = ()  # per-parameter state cleared by start_round(reset_state=True)
    _accepts_correction: bool = True
    _float32_state: Tuple[str, ...] = ()  # state kept in float32 (float64 for float64 params)
    _state_keys: Tuple[str, ...] = ("x0", "correction")  # every per-parameter state key this class keeps
    _step_input: Optional[str] = None  # name of the per-step tensor-list argument of step(), if any
    # torch.amp.GradScaler hands grad_scale / found_inf to step(): unscaling happens inside the kernels
    _step_supports_amp_scaling = True
    _plan_cls: Type[StepPlan] = StepPlan  # dtensor.ShardedPlan when the parameters are DTensors

    @classmethod
    def op_spec(cls) -> OpSpec:
        """The op this optimizer's step runs (its declaration in ``core/ops.py``)."""
        return cls._spec

    def __init__(
        self, params: Iterable, defaults: Dict[str, Any], backend: str = "auto", replay: Optional[bool] = None
    ):
        if not isinstance(backend, str) or (backend != "auto" and backend not in _registry.BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {_registry.BACKENDS}, got {backend!r}")
        self.backend = backend
        self._replay_on = _replay.resolve_switch(replay)  # docs/replay.md
        self._replay: Optional[_replay.StepReplay] = _replay.StepReplay() if self._replay_on else None
        self._prologue: Optional[_replay.Prologue] = None  # work the next launch runs first (FedSAM's restore)
        self._t = -1  # index of the current round (-1: no round started yet)
        self._k_host: Any = 0  # within-round step counter until the device counter exists (client-batched: a list)
        self._k_dev: Optional[torch.Tensor] = None  # int32 [1] on the parameters' device (authoritative)
        self._host_steps = 0  # step() calls since start_round: an upper bound of k (table sizes)
        self._params_flat: List[torch.Tensor] = []
        self._plan: Optional[StepPlan] = None
        self._ones: Dict[torch.device, torch.Tensor] = {}
        self._hp_cache = HpCache()  # the last hp rows and their device copy, shared by rebuilt plans
        self._handle = _step_op.register(self._run)
        self._hp_names = tuple(defaults)  # what a state_dict's param groups must carry to be ours
        self._lr_checked: List[torch.Tensor] = []  # tensor lrs whose value was validated (by identity)
        # a CUDA graph of the caller's holding a step (docs/replay.md, "A whole iteration in one graph"):
        # the plan it reads, how many steps of a round its decay table covers (None: all), retired plans
        self._graph_plan: Optional[StepPlan] = None
        self._graph_cover: Optional[int] = None
        self._retired: List[StepPlan] = []
        self._capture_steps = 0  # prepare_capture's steps per round (0: not called)
        super().__init__(params, defaults)

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

    # ---------------------------------------------------------------- hyperparameters and params
    def _validate_group(self, group: Dict[str, Any]) -> None:
        """Raise ValueError naming the hyperparameter that is out of range (subclasses extend)."""
        if isinstance(group["lr"], torch.Tensor):
            self._check_lr(group, read_value=None)
        else:
            check_number("lr", group["lr"], low=0.0)
        if "prox_mu" in group:
            check_number("prox_mu", group["prox_mu"], low=0.0)

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
        the current round; subclasses derive values, e.g. FedNAR's annealed step size)."""
        return [float(group[name]) for name in self._spec.hps]

    def _lr_factor(self, group: Dict[str, Any], t: Optional[int] = None) -> float:
        """What ``_hp_row`` multiplies the learning rate by (FedNAR: its round annealing)."""
        return 1.0

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
            ext = _extent(p)
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

    # ---------------------------------------------------------------- round API
    @property
    def round_index(self) -> int:
        """t: the number of start_round calls so far, minus one."""
        return self._t

    @property
    def round_step(self) -> int:
        """k: the number of steps taken since the last start_round (reads the device counter)."""
        return int(self._k_dev.reshape(-1)[0]) if self._k_dev is not None else self._k_host

    def _check_round_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        """Validate the algorithm's own start_round inputs; return them normalised (subclasses)."""
        if inputs:
            raise TypeError(f"{type(self).__name__}.start_round() got unexpected inputs {sorted(inputs)}")
        return {}

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        """Store the validated per-round inputs in the state (subclasses)."""

    @torch.no_grad()
    def start_round(
        self, *, reset_state: bool = True, correction: Optional[Sequence[torch.Tensor]] = None, **inputs: Any
    ) -> None:
        """Begin local training on a freshly received global model (docs/algorithms.md).

        Resets the within-round step counter, clears per-round state (momentum buffers, ...)
        unless ``reset_state=False``, snapshots the FedProx anchor ``x0`` for groups with
        ``prox_mu > 0``, and stores the SCAFFOLD ``correction`` (``c - c_i``, one tensor per
        parameter in param-group order) that is added to every gradient of the round.
        """
        params = self._params_flat
        if correction is not None:
            if not self._accepts_correction:
                raise TypeError(f"{type(self).__name__}.start_round() takes no 'correction'")
            correction = check_tensor_list("correction", correction, params, self._name_of)
        inputs = self._check_round_inputs(inputs)
        self._check_graph_round()
        # everything validated: from here on nothing raises
        self._retire_graph()
        self._t += 1
        self._k_host = 0
        self._host_steps = 0
        if self._k_dev is not None:
            self._k_dev.zero_()
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
        self._plan = None

    # ---------------------------------------------------------------- step
    def _step_tensors(
        self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
        """Optional-role tensors of ``p`` for its step, and per-tensor hp overrides (subclasses extend).

        Parameters with the same roles and overrides in one group share a batch (an hp row).
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
        """Bits of a batch's ``present`` mask beyond its roles (the batched SGD's FRESH)."""
        return 0

    def _step_roles(self) -> Tuple[str, ...]:
        """Optional roles fed from ``step()``'s per-step input rather than from the state."""
        return ()

    def _check_step_inputs(self, value: Any) -> Dict[str, List[Optional[torch.Tensor]]]:
        """Validate ``step(<_step_input>=value)``: role -> one tensor (or None) per parameter (subclasses)."""
        return {}

    def _schedule(self) -> Optional[DecaySchedule]:
        return None

    def _active_for(self, device: torch.device) -> Optional[torch.Tensor]:
        """The active-client mask a client-batched op reads (the mixin's); per-client ops take none."""
        return None

    def _clients(self) -> Optional[int]:
        """Clients of a client-batched optimizer (hp rows per client); None for a per-client one."""
        return None

    def _plan_inputs(self) -> PlanInputs:
        """What the step plan is built from, gathered with this class's hooks. Creates the state
        tensors this step needs (momentum buffers) and checks every gradient, naming the parameter."""
        spec, owner = self._spec, type(self).__name__
        self._plan_cls.refuse(spec, owner)
        groups = self._group_inputs(range(len(self.param_groups)))
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
                tensors, override = self._step_tensors(p, group, st, idx)
                if fresh and st:
                    self.state[p] = st
                members.append(Member(idx, gi, tensors, override, self._extra_present(tensors)))
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
            self._step_roles(),
            self._clients(),
            self._hp_cache,
        )

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
        args = (
            params,
            plan.current_grads(),
            *[lists[r.name] for r in spec.optional],
            plan.batch,
            plan.present,
            plan.hp,
            k,
            table,
            every,
            grad_scale,
            found_inf,
            *((active,) if spec.batched else ()),
            plan.backend,
        )
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

    # ---------------------------------------------------------------- a CUDA graph of the caller's
    def prepare_capture(self, steps_per_round: int) -> None:
        """Ready what a CUDA graph holding ``step()`` reads for the first ``steps_per_round`` steps of
        a round. A graph's replays advance the within-round step counter ``k`` on the device without
        the optimizer seeing them, so a table the kernels index by ``k`` must be complete before the
        capture: FedDecaySGD's ``s(k // decay_every)`` is tabulated here for every ``k <
        steps_per_round`` (the other optimizers read no such table). A capture that needs it and
        was not prepared is refused (docs/replay.md, "A whole iteration in one graph")."""
        if isinstance(steps_per_round, bool) or not isinstance(steps_per_round, int) or steps_per_round < 1:
            raise ValueError(f"steps_per_round must be an integer >= 1, got {steps_per_round!r}")
        sched = self._schedule()
        params = self._params_flat
        if sched is not None and params:
            device = params[0].device
            if capturing(device):
                raise RuntimeError(
                    "prepare_capture() copies the decay table to the device: call it before the capture, not inside it"
                )
            sched.table(device, steps_per_round - 1)
        self._capture_steps = steps_per_round

    def _enter_capture(self, plan: StepPlan, sched: Optional[DecaySchedule], device: torch.device) -> None:
        """This step goes into a CUDA graph the caller is capturing, whose replays will not call
        ``step()``: refuse what they would compute wrongly, and remember the plan they read."""
        me = type(self).__name__
        step = self.__dict__.get("step")  # an LR scheduler wraps the bound step() of its optimizer
        if getattr(step, "_wrapped_by_lr_sched", False) and any(
            not isinstance(g["lr"], torch.Tensor) for g in self.param_groups
        ):
            raise RuntimeError(
                f"an LR scheduler steps {me}'s learning rate, a float in param_groups, which the replays of "
                f"a CUDA graph never read (they read the values the capture saw); give the optimizer a "
                f"tensor lr on the parameters' device, e.g. lr=torch.tensor(0.05, device='{device}'): "
                f"the scheduler fills it in place and every replay reads it"
            )
        cover = None
        if sched is not None:
            every = sched.decay_every
            n = sched.length(device)
            if n * every <= max(self._host_steps, self._capture_steps - 1) or not (
                sched.constant_after(n) or self._capture_steps
            ):
                raise RuntimeError(
                    f"{me} reads its within-round decay s(k // decay_every) from a table on the device, "
                    f"and the replays of a CUDA graph advance k without {me} seeing them, so the table "
                    f"must cover every step of the round before the capture (it holds s for the first "
                    f"{n * every} steps): call opt.prepare_capture(steps) with the most steps of a round "
                    f"the graph will take, before capturing"
                )
            cover = None if sched.constant_after(n) else n * every
        self._graph_plan = plan
        self._graph_cover = cover

    def _check_graph_round(self) -> None:
        """At a round start after a round whose steps a graph of the caller's took with a decay
        table that ends (``_graph_cover`` steps): raise once if it took more. Reads the device step
        counter (a host sync, only after such a round)."""
        cover = self._graph_cover
        if cover is None or self._k_dev is None:
            return
        self._graph_cover = None
        k = int(self._k_dev.max())
        if k > cover:
            raise RuntimeError(
                f"round {self._t} of {type(self).__name__} took {k} steps, but the decay table of the CUDA "
                f"graph that took them covers {cover}: its steps past {cover} used the table's last "
                f"s instead of s(k // decay_every), so the round's result is wrong. Call "
                f"opt.prepare_capture(steps) with the round's number of steps before capturing (this "
                f"error is raised once; call start_round() again to go on)"
            )

    def _retire_graph(self) -> None:
        """The plan a graph of the caller's read is being dropped (a round start, new param groups or
        state, a rebuilt plan): later replays of that graph would step with tensors and
        hyperparameters the optimizer no longer uses. Its hp tensor is filled with NaN, so that such
        a replay turns the parameters into NaN rather than into plausible numbers, and the plan is
        kept (with the tensors its graph writes) so that the replay writes nowhere else; the next
        plan gets an hp tensor of its own."""
        plan = self._graph_plan
        self._graph_cover = None
        if plan is None:
            return
        self._graph_plan = None
        plan.hp.fill_(float("nan"))
        self._retired = [plan] + [p for p in self._retired if p is not plan][: RETIRED_GRAPHS - 1]
        self._hp_cache = HpCache()

    # ---------------------------------------------------------------- for code that captures steps
    # A caller that captures step() into a graph of its own and replays it (sim/parallel/step_graph.py)
    # keeps the plan the capture read and tells the optimizer what the replays did, through these three.
    @property
    def step_plan(self) -> Optional[StepPlan]:
        """The plan the next step runs: None before the first step and after anything that drops it
        (a round start, a new param group, ``load_state_dict``)."""
        return self._plan

    def reinstate_plan(self, plan: StepPlan) -> None:
        """Make ``plan`` (this optimizer's, kept by a captured graph) the step's plan again, its
        hyperparameter rows rewritten in place from the current param groups: a graph reading
        ``plan.hp`` then sees this round's values."""
        groups = self._group_inputs(range(len(self.param_groups)))
        host = plan.hp_rows([groups[gi] for gi in range(len(groups))])
        plan.hp.copy_(host)
        self._plan = plan
        self._graph_plan = plan  # a graph reads it: a later round start retires it until reinstated again
        self._hp_cache.keep(host, plan.hp)

    @property
    def step_plans(self) -> Tuple[Any, ...]:
        """Everything the next step launches through a ``fn`` attribute, in launch order: its plan
        (none before the first step). FedSAM's: its ascent's plan, its restore, its descent's plan."""
        return () if self._plan is None else (self._plan,)

    def reinstate_plans(self, plans: Sequence[Any]) -> None:
        """``reinstate_plan`` for what ``step_plans`` returned (a captured step's launches)."""
        self.reinstate_plan(plans[-1])

    def note_replayed_steps(self, n: int = 1) -> None:
        """Count ``n`` steps a replay took without ``step()``: the host-side count that sizes the
        decay table and that PAdaMFed's ``local_control`` checks."""
        self._host_steps += n

    def replay_stats(self) -> Dict[str, Any]:
        """How this optimizer's steps ran on a GPU (docs/replay.md): ``eager``, ``recorded`` (a CUDA
        graph made, and replayed for that step), ``replayed`` and ``wasted`` (recordings dropped
        without a replay) step counts, ``recordings`` held now, and ``on`` / ``off_reason``."""
        rep = self._replay
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
        return {
            "on": rep.off_reason is None,
            "off_reason": rep.off_reason,
            **rep.stats,
            "recordings": len(rep.recordings),
        }

    def resolved_backend(self) -> str:
        """The backend ``step()`` uses for this optimizer's parameters (resolving ``"auto"``)."""
        params = self._params_flat
        device = params[0].device if params else torch.device("cpu")
        return _registry.auto_backend(device, self._spec.name) if self.backend == "auto" else self.backend

    # ---------------------------------------------------------------- state_dict
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


def replayable(plan: StepPlan) -> bool:
    """Can this plan's steps be recorded (docs/replay.md, "Always eager")? Decided once per plan."""
    ok = plan.replayable
    if ok is None:
        ok = plan.replayable = (
            not plan.one_shot
            and type(plan) is StepPlan
            and plan.backend in _replay.BACKENDS
            and plan.device.type in _replay.DEVICE_TYPES
        )
    return ok


def round_entry(state_dict: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The saved round counters: top level, or (torch.distributed.checkpoint) in the param groups."""
    rnd = state_dict.get(ROUND_KEY)
    if rnd is None and state_dict.get("param_groups"):
        rnd = state_dict["param_groups"][0].get(ROUND_KEY)
    return rnd


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """dtype of float32-kept state (control variates, accumulators, scales) for parameter ``p``."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32
