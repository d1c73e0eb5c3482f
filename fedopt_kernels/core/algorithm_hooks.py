"""What an algorithm's optimizer sets and overrides: the bottom of ``FedOptimizer`` (docs/dispatch.md).

``AlgorithmHooks`` holds the class attributes a subclass sets, every hook it overrides with its
default, and the declarations of the state the rest of the base reads (``FedOptimizer.__init__``
sets it). The base's other parts build on it, one concern per file, each on the one before:

====================================  ==================================================================
``caller_graph.CallerGraph``          a CUDA graph of the caller's that holds a step
``param_checks.ParamChecks``          parameters and param groups: refused with an error naming them
``gather.PlanGather``                 the hooks' results gathered into a step plan's inputs
``round_api.RoundAPI``                ``start_round`` and the round counters
``dispatch.StepDispatch``             ``step()``: the plan, the device counters, the launch, replays
``other_ops.OtherOps``                a second op a step runs (FedSAM's ascent)
``captured_steps.CapturedSteps``      code that captures steps itself (the simulator's step graph)
``state_format.StateFormat``          ``state_dict``, ``load_state_dict`` and copies
====================================  ==================================================================
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

import torch
from torch.optim import Optimizer

from . import hp_columns
from .checks import check_lr_tensor, check_number
from .hp_columns import Column
from .op_runner import OpRunner, OtherOp
from .ops import OpSpec
from .plan import HpCache, StepPlan
from .replay import Prologue, StepReplay
from .schedules import DecaySchedule


class AlgorithmHooks(Optimizer):
    """The class attributes and hooks of docs/dispatch.md's table, with their defaults."""

    # ---------------------------------------------------------------- what a subclass sets
    _spec: OpSpec  # the op step() runs
    _round_state: Tuple[str, ...] = ()  # per-parameter state cleared by start_round(reset_state=True)
    _accepts_correction: bool = True
    _float32_state: Tuple[str, ...] = ()  # state kept in float32 (float64 for float64 params)
    _state_keys: Tuple[str, ...] = ("x0", "correction")  # every per-parameter state key this class keeps
    _step_input: Optional[str] = None  # name of the per-step tensor-list argument of step(), if any
    # torch.amp.GradScaler hands grad_scale / found_inf to step(): unscaling happens inside the kernels
    _step_supports_amp_scaling = True
    # op hp column -> what fills it where that is not the group's value of the column's name
    _hp_columns: Mapping[str, Column] = {}
    _other_ops: Tuple[OtherOp, ...] = ()  # the ops a step runs besides _spec (other_ops.py)
    _plan_cls: Type[StepPlan] = StepPlan  # dtensor.ShardedPlan when the parameters are DTensors

    # ---------------------------------------------------------------- the base's state (FedOptimizer.__init__)
    backend: str
    _replay_on: bool
    _replay: Optional[StepReplay]
    _prologue: Optional[Prologue]  # work the next launch runs first (FedSAM's restore)
    _t: int  # index of the current round (-1: no round started yet)
    _k_host: Any  # within-round step counter until the device counter exists (client-batched: a list)
    _k_dev: Optional[torch.Tensor]  # int32 [1] on the parameters' device (authoritative)
    _host_steps: int  # step() calls since start_round: an upper bound of k (table sizes)
    _params_flat: List[torch.Tensor]
    _plan: Optional[StepPlan]
    _ones: Dict[torch.device, torch.Tensor]
    _hp_cache: HpCache  # the last hp rows and their device copy, shared by rebuilt plans
    _handle: int  # step_op's handle of this optimizer's eager step
    _hp_names: Tuple[str, ...]  # what a state_dict's param groups must carry to be ours
    _lr_checked: List[torch.Tensor]  # tensor lrs whose value was validated (by identity)
    _runners: Dict[str, OpRunner]  # each of _other_ops' plan, counters and replay
    # a CUDA graph of the caller's holding a step (caller_graph.py): the plan it reads, how many
    # steps of a round its decay table covers (None: all), retired plans, prepare_capture's steps
    _graph_plan: Optional[StepPlan]
    _graph_cover: Optional[int]
    _retired: List[StepPlan]
    _capture_steps: int

    @classmethod
    def op_spec(cls) -> OpSpec:
        """The op this optimizer's step runs (its declaration in ``core/ops.py``)."""
        return cls._spec

    # ---------------------------------------------------------------- hyperparameters
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
        the current round): ``_hp_columns``' values (``hp_columns.py``); subclasses derive values,
        e.g. FedNAR's annealed step size."""
        return hp_columns.row(self._spec, self._hp_columns, group)

    def _lr_factor(self, group: Dict[str, Any], t: Optional[int] = None) -> float:
        """What ``_hp_row`` multiplies the learning rate by (FedNAR: its round annealing)."""
        return 1.0

    # ---------------------------------------------------------------- round inputs
    def _check_round_inputs(self, inputs: Dict[str, Any]) -> Dict[str, Any]:
        """Validate the algorithm's own start_round inputs; return them normalised (subclasses)."""
        if inputs:
            raise TypeError(f"{type(self).__name__}.start_round() got unexpected inputs {sorted(inputs)}")
        return {}

    def _apply_round_inputs(self, inputs: Dict[str, Any]) -> None:
        """Store the validated per-round inputs in the state (subclasses)."""

    # ---------------------------------------------------------------- a step's tensors
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

    # ---------------------------------------------------------------- the client-batched mixin's
    def _active_for(self, device: torch.device) -> Optional[torch.Tensor]:
        """The active-client mask a client-batched op reads (the mixin's); per-client ops take none."""
        return None

    def _clients(self) -> Optional[int]:
        """Clients of a client-batched optimizer (hp rows per client); None for a per-client one."""
        return None
