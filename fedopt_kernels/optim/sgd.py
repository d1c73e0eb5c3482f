"""What FedDecaySGD and NeuronLRSGD share: torch.optim.SGD's options on the round API, op "sgd"."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from ..core.ops import SGD
from ..core.optimizer import FedOptimizer, check_number
from ..fl.algorithm import Algorithm, Variant
from ..fl.server_rules import RULES


class SGDFamily(FedOptimizer):
    """SGD with momentum/dampening/nesterov/weight decay/maximize plus FedProx and SCAFFOLD terms."""

    _spec = SGD
    _round_state = ("momentum_buffer",)
    _state_keys: Tuple[str, ...] = ("momentum_buffer", "x0", "correction")

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
    """The client side of the SGD-family algorithms: the round's lr is set by the run
    (``lr * round_decay ** t``) and ``clip_norm`` clips gradients before the step."""

    def round_lr(self, hp: Mapping[str, Any], t: int) -> Optional[float]:
        return hp["lr"] * hp["round_decay"] ** t

    def clip_norm(self, hp: Mapping[str, Any]) -> Optional[float]:
        return hp["clip_norm"]

    def state_copies(self, cfg: Any, variant: Variant) -> int:
        # momentum buffer, a correction from what the client keeps (SCAFFOLD), FedProx anchor
        return int(cfg.momentum != 0) + int(RULES[variant.server].keeps) + int(variant.prox)
