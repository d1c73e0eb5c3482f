"""What FedDecaySGD and NeuronLRSGD share: torch.optim.SGD's options on the round API, op "sgd"."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..core.ops import SGD
from ..core.optimizer import FedOptimizer, check_number
from ..core.schedules import DecaySchedule
from ..fl.algorithm import Algorithm, Baseline, Variant
from ..fl.server_rules import RULES

# the benchmark's rows of torch.optim.SGD: the step a user has today
TORCH_FUSED = "torch.SGD(fused)"
TORCH_FOREACH = "torch.SGD(foreach)"


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


class SGDAlgorithm(Algorithm):
    """The client side of the SGD-family algorithms: ``clip_norm`` clips gradients before the step
    (the round's lr, ``lr * round_decay ** t``, is the optimizer's own: ``make`` passes
    ``round_decay``)."""

    def clip_norm(self, hp: Mapping[str, Any]) -> Optional[float]:
        return hp["clip_norm"]

    def state_copies(self, cfg: Any, variant: Variant) -> int:
        # momentum buffer, a correction from what the client keeps (SCAFFOLD), FedProx anchor
        return int(cfg.momentum != 0) + int(RULES[variant.server].keeps) + int(variant.prox)


def _torch_sgd(flag: str):
    def build(params: List[torch.Tensor], kwargs: Mapping[str, Any]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, **kwargs, **{flag: True})

    return build


def torch_sgd(**kwargs: Any) -> Tuple[Baseline, ...]:
    """``torch.optim.SGD(fused=True)`` and ``(foreach=True)`` with ``kwargs``: benchmark baselines for a
    row whose work plain SGD does too (counted at plain SGD's bytes per element)."""
    traffic = ("sgd", ("momentum_buffer",) if kwargs.get("momentum", 0) else ())
    return tuple(
        Baseline(name, _torch_sgd(flag), kwargs=dict(kwargs), traffic=traffic, by_hand=False)
        for name, flag in ((TORCH_FUSED, "fused"), (TORCH_FOREACH, "foreach"))
    )
