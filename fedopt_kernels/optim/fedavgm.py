"""FedAvgM: server momentum on the round's pseudo-gradient (docs/algorithms.md, server optimizers)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Tuple

import torch

from ..core.ops import SGD
from ..core.optimizer import check_number
from .server import ServerOptimizer


class FedAvgM(ServerOptimizer):
    r"""Server SGD with momentum on the pseudo-gradient ``g = -Delta`` (FedAvgM).

    From "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
    Classification" (Tzu-Ming Harry Hsu, Hang Qi, Matthew Brown; 2019). Each step, for every
    parameter ``x`` with ``g = p.grad``::

        m  = momentum * m + g                     (m starts at 0: the first step takes m = g)
        x -= lr * m                               (nesterov: x -= lr * (g + momentum * m))

    which is ``torch.optim.SGD(lr, momentum, nesterov)`` on ``g``; ``momentum=0`` is FedAvg with a
    server learning rate. State: ``momentum_buffer`` (the parameter's dtype, as torch.optim.SGD's).
    Runs op ``sgd`` on every backend.
    """

    _spec = SGD
    _state_keys = ("momentum_buffer",)
    # the sgd op's columns FedAvgM has no option for
    _hp_columns = {"dampening": 0.0, "weight_decay": 0.0, "prox_mu": 0.0, "maximize": 0.0}

    def __init__(
        self, params: Iterable, lr: Any = 1.0, momentum: float = 0.9, nesterov: bool = False, *, backend: str = "auto"
    ):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov), backend)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("momentum", group["momentum"], low=0.0)
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov must be a bool, got {type(group['nesterov']).__name__}")
        if group["nesterov"] and group["momentum"] <= 0:
            raise ValueError("nesterov=True requires momentum > 0")

    def _structure(self, group: Dict[str, Any]) -> tuple:
        return super()._structure(group) + (group["momentum"] != 0,)

    def _step_tensors(
        self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
        tensors, override = super()._step_tensors(p, group, state, idx)
        if group["momentum"] != 0:
            buf = state.get("momentum_buffer")
            if buf is None:  # zeros: momentum * 0 + g is torch's first step, buf = g
                buf = state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            tensors["momentum_buffer"] = buf
        return tensors, override
