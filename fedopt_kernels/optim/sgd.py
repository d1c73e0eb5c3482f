"""What FedDecaySGD and NeuronLRSGD share: torch.optim.SGD's options on the round API, op "sgd"."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ..core.ops import SGD
from ..core.optimizer import FedOptimizer, check_number
from ..core.schedules import DecaySchedule


class SGDFamily(FedOptimizer):
    """SGD with momentum/dampening/nesterov/weight decay/maximize plus FedProx and SCAFFOLD terms, and
    a within-round learning-rate decay ``s(k // decay_every)`` where ``schedule`` is set (FedDecaySGD,
    FedDyn; FedDecay, Eq. 4)."""

    _spec = SGD
    _round_state = ("momentum_buffer",)
    _state_keys: Tuple[str, ...] = ("momentum_buffer", "x0", "correction")
    schedule: Optional[DecaySchedule] = None  # the within-round decay, or none (s = 1)

    def _schedule(self) -> Optional[DecaySchedule]:
        return self.schedule

    def current_lr_factor(self) -> float:
        """s(k // decay_every) for the next step (1.0 without a within-round schedule)."""
        return 1.0 if self.schedule is None else self.schedule.factor(self.round_step)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("momentum", group["momentum"], low=0.0)
        check_number("dampening", group["dampening"], low=0.0, high=1.0)
        check_number("weight_decay", group["weight_decay"], low=0.0)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov=True requires momentum > 0 and dampening = 0")

    def _structure(self, group: Dict[str, Any]) -> tuple:
        return super()._structure(group) + (group["momentum"] != 0,)

    def _step_tensors(
        self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
        tensors, override = super()._step_tensors(p, group, state, idx)
        if group["momentum"] != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                # zeros + dampening 0 gives buf = d on the first step, as torch's clone(d) does
                buf = state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                override["dampening"] = 0.0
            tensors["momentum_buffer"] = buf
        return tensors, override
