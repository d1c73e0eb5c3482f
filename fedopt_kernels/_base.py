"""The round API (SPEC §1) and backend dispatch shared by every optimizer of the package.

A subclass states its op name, how to validate its hyperparameters, which per-parameter tensors a
step needs (``_step_tensors``) and which derived values go into ``Group.hp`` (``_step_hp``). This
class does the rest: ``start_round``, FedProx anchors, SCAFFOLD corrections, splitting param groups
into uniform ``Group`` batches, resolving the backend, and saving the round counters in
``state_dict``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.optim import Optimizer

from . import _registry
from ._batch import DeviceCounters, Group, StepContext
from .schedules import DecaySchedule

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ROUND_KEY = "fedopt_round"


def check_number(name: str, value: Any, *, low: Optional[float] = None, high: Optional[float] = None,
                 low_open: bool = False) -> float:
    """Return ``float(value)`` or raise ValueError naming ``name`` when it is not a finite number in range."""
    if isinstance(value, torch.Tensor):
        # reading a CUDA tensor back would be a host sync inside step(); say so instead
        raise TypeError(f"{name} must be a Python number, got a tensor (tensor hyperparameters are not supported)")
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


def _param_name(gi: int, pi: int, p: torch.Tensor) -> str:
    return f"parameter {pi} of param group {gi} (shape {tuple(p.shape)})"


def _check_tensor_list(name: str, tensors: Sequence[torch.Tensor], params: List[torch.Tensor],
                       param_names: List[str]) -> List[torch.Tensor]:
    """Check a per-parameter list (controls, corrections) against the parameters; return detached copies."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, one per parameter, got {type(tensors).__name__}")
    if len(tensors) != len(params):
        raise ValueError(f"{name} has {len(tensors)} tensors but the optimizer has {len(params)} parameters")
    out = []
    for t, p, pname in zip(tensors, params, param_names):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} entry for {pname} is {type(t).__name__}, not a tensor")
        if t.shape != p.shape:
            raise ValueError(f"{name} entry for {pname} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        if t.device != p.device:
            raise ValueError(f"{name} entry for {pname} is on {t.device}, expected {p.device}")
        if t.is_complex() or t.is_sparse:
            raise TypeError(f"{name} entry for {pname} must be a dense real tensor")
        out.append(t)
    return out


class FedOptimizer(Optimizer):
    """Base class: an optimizer with the FL round API of SPEC §1 and a pluggable backend."""

    _op: str = ""                  # registry op this optimizer's step calls
    _round_state: Tuple[str, ...] = ()  # per-parameter state cleared by start_round(reset_state=True)
    _accepts_correction: bool = True
    _float32_state: Tuple[str, ...] = ()  # state kept in float32 (float64 for float64 params)

    def __init__(self, params: Iterable, defaults: Dict[str, Any], backend: str = "auto"):
        if backend != "auto" and backend not in _registry.BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {_registry.BACKENDS}, got {backend!r}")
        super().__init__(params, defaults)
        self.backend = backend
        self._t = -1           # index of the current round (-1: no round started yet)
        self._k = 0            # steps since start_round
        self._counters = DeviceCounters()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.is_complex():
                    raise TypeError(f"{_param_name(gi, pi, p)} is complex; {type(self).__name__} supports real parameters only")
                if p.dtype not in _FLOAT_DTYPES:
                    raise TypeError(f"{_param_name(gi, pi, p)} has dtype {p.dtype}; supported: {_FLOAT_DTYPES}")

    # ---------------------------------------------------------------- hyperparameters
    def _validate_group(self, group: Dict[str, Any]) -> None:
        """Raise ValueError naming the hyperparameter that is out of range (subclasses extend)."""
        check_number("lr", group["lr"], low=0.0)
        if "prox_mu" in group:
            check_number("prox_mu", group["prox_mu"], low=0.0)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._validate_group(self.param_groups[-1])

    # ---------------------------------------------------------------- round API
    @property
    def round_index(self) -> int:
        """t: the number of start_round calls so far, minus one."""
        return self._t

    @property
    def round_step(self) -> int:
        """k: the number of steps taken since the last start_round."""
        return self._k

    def _all_params(self) -> Tuple[List[torch.Tensor], List[str]]:
        params, names = [], []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                params.append(p)
                names.append(_param_name(gi, pi, p))
        return params, names

    def _check_round_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        """Validate the algorithm's own start_round inputs; return them normalised (subclasses)."""
        if inputs:
            raise TypeError(f"{type(self).__name__}.start_round() got unexpected inputs {sorted(inputs)}")
        return {}

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        """Store the validated per-round inputs in the state (subclasses)."""

    @torch.no_grad()
    def start_round(self, *, reset_state: bool = True, correction: Optional[Sequence[torch.Tensor]] = None,
                    **inputs: Any) -> None:
        """Begin local training on a freshly received global model (SPEC §1).

        Resets the within-round step counter, clears per-round state (momentum buffers, ...)
        unless ``reset_state=False``, snapshots the FedProx anchor ``x0`` for groups with
        ``prox_mu > 0``, and stores the SCAFFOLD ``correction`` (``c - c_i``, one tensor per
        parameter in param-group order) that is added to every gradient of the round.
        """
        params, names = self._all_params()
        if correction is not None:
            if not self._accepts_correction:
                raise TypeError(f"{type(self).__name__}.start_round() takes no 'correction'")
            correction = _check_tensor_list("correction", correction, params, names)
        inputs = self._check_round_inputs(inputs)
        # everything validated: from here on nothing raises
        self._t += 1
        self._k = 0
        self._counters.reset()
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if reset_state:
                    for key in self._round_state:
                        st.pop(key, None)
                st.pop("correction", None)
                st.pop("x0", None)
                if group.get("prox_mu", 0.0) != 0.0:
                    st["x0"] = p.detach().clone(memory_format=torch.preserve_format)
        if correction is not None:
            for p, c in zip(params, correction):
                self.state[p]["correction"] = c.detach().to(dtype=p.dtype).clone()
        self._apply_round_inputs(inputs)

    # ---------------------------------------------------------------- step
    def _step_hp(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """The hyperparameters a backend sees for one group this step (subclasses add derived values)."""
        return {k: v for k, v in group.items() if k != "params"}

    def _step_tensors(self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any],
                      step_inputs: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
        """Per-parameter tensors for this step and per-tensor hp overrides (subclasses).

        Tensors with the same names and overrides are batched into one ``Group``.
        """
        out = {}
        if "x0" in state and group.get("prox_mu", 0.0) != 0.0:
            out["x0"] = state["x0"]
        if "correction" in state:
            out["correction"] = state["correction"]
        return out, {}

    def _check_step_inputs(self, step_inputs: Dict[str, Any], params: List[torch.Tensor],
                           names: List[str]) -> Dict[torch.Tensor, Dict[str, torch.Tensor]]:
        """Validate extra step() arguments; map param -> {name: tensor} (subclasses)."""
        if step_inputs:
            raise TypeError(f"{type(self).__name__}.step() got unexpected arguments {sorted(step_inputs)}")
        return {}

    def _schedule(self) -> Optional[DecaySchedule]:
        return None

    def _collect(self, step_inputs: Dict[str, Any]) -> List[Group]:
        params, names = self._all_params()
        per_param_inputs = self._check_step_inputs(step_inputs, params, names)
        device = None
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group)
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                pname = _param_name(gi, pi, p)
                if g.is_sparse:
                    raise RuntimeError(f"{pname} has a sparse gradient; {type(self).__name__} does not support sparse gradients")
                if p.is_complex() or g.is_complex():
                    raise TypeError(f"{pname} is complex; {type(self).__name__} supports real parameters only")
                if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                    raise RuntimeError(f"{pname}: gradient of shape {tuple(g.shape)}, {g.dtype}, {g.device} does not match the parameter")
                if group.get("prox_mu", 0.0) != 0.0 and "x0" not in self.state[p] and self._t >= 0:
                    raise RuntimeError(f"prox_mu of param group {gi} was set after start_round(); the FedProx anchor x0 "
                                       f"is taken at start_round(), so call start_round() again")
                if device is None:
                    device = p.device
                elif p.device != device:
                    raise RuntimeError(f"{pname} is on {p.device} but other parameters are on {device}; "
                                       f"{type(self).__name__} needs all parameters on one device")
        batches: Dict[Tuple, Group] = {}
        order: List[Tuple] = []
        for gi, group in enumerate(self.param_groups):
            hp = self._step_hp(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                tensors, override = self._step_tensors(p, group, self.state[p], per_param_inputs.get(p, {}))
                key = (gi, tuple(sorted(tensors)), tuple(sorted(override.items())))
                if key not in batches:
                    batches[key] = Group([], [], {**hp, **override}, {name: [] for name in tensors})
                    order.append(key)
                b = batches[key]
                b.params.append(p)
                b.grads.append(p.grad)
                for name, t in tensors.items():
                    b.tensors[name].append(t)
        return [batches[key] for key in order]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, **step_inputs: Any) -> Optional[float]:
        """One local step (torch.optim semantics). Starts a round first if none was started."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._t < 0:
            self.start_round()
        groups = self._collect(step_inputs)
        if groups:
            fn = _registry.resolve(self._op, self.backend, groups[0].params[0].device)
            ctx = StepContext(self._k, self._t, self._schedule(), self._counters)
            fn(groups, ctx)
        self._counters.advance()
        self._k += 1
        return loss

    def resolved_backend(self) -> str:
        """The backend ``step()`` uses for this optimizer's parameters (resolving ``"auto"``)."""
        params, _ = self._all_params()
        device = params[0].device if params else torch.device("cpu")
        return _registry.auto_backend(device, self._op) if self.backend == "auto" else self.backend

    # ---------------------------------------------------------------- state_dict
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd[_ROUND_KEY] = {"t": self._t, "k": self._k}
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        rnd = state_dict.get(_ROUND_KEY)
        if rnd is None:
            raise ValueError(f"state_dict has no '{_ROUND_KEY}' entry; it was not saved by a fedopt_kernels optimizer")
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
        sd = {k: v for k, v in state_dict.items() if k != _ROUND_KEY}
        sd["state"] = state
        super().load_state_dict(sd)
        params, _ = self._all_params()
        for pid, p in zip(saved_ids, params):
            for key, value in kept.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=state_dtype(p))
        self._t, self._k = int(rnd["t"]), int(rnd["k"])
        self._counters.forget()


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """dtype of float32-kept state (control variates, accumulators, scales) for parameter ``p``."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32
