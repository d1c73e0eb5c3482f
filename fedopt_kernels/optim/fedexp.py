"""FedExP: the server step size from the clients' update norms (docs/algorithms.md, server optimizers)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Optional, Union

import torch

from ..core.ops import FEDEXP
from ..core.optimizer import Prologue, check_number
from .server import ServerOptimizer

_MSN = FEDEXP.hp_index("mean_sq_norm")


def _fill(opt: FedExP, value: Union[float, torch.Tensor]) -> None:
    """Write this step's mean squared client-update norm into the plan's hp column (tensor to tensor:
    no host sync for a device value)."""
    plan = opt.step_plan
    if plan is not None and plan.params:
        plan.hp[..., _MSN].fill_(value)


class FedExP(ServerOptimizer):
    r"""FedExP: extrapolation of the server step, from the clients' own update norms.

    From "FedExP: Speeding Up Federated Averaging via Extrapolation" (Divyansh Jhunjhunwala, Shiqiang
    Wang, Gauri Joshi; ICLR 2023). ``p.grad = g = -Delta`` (the round's weighted mean update) and
    ``step(mean_sq_norm=...)`` takes ``sum_i w_i ||Delta_i||^2 / sum_i w_i``, the weighted mean of the
    clients' squared update norms (each over all parameters)::

        s     = || all g ||_2                                   (over every param group, float64)
        eta_g = max(1, mean_sq_norm / (2 (s^2 + eps)))
        x    -= lr * eta_g * g                                  (lr = 1: x + eta_g Delta)

    ``eps`` (default 1e-3) is the paper's; ``lr`` (keyword, default 1) scales the step. ``eta_g``
    stays on the device. Runs op ``fedexp`` (two passes: the norm, then the update).
    """

    _spec = FEDEXP
    _hp_columns = {"mean_sq_norm": 0.0}  # written on the device at each step (step's argument)

    def __init__(self, params: Iterable, eps: float = 1e-3, *, lr: Any = 1.0, backend: str = "auto"):
        super().__init__(params, dict(lr=lr, eps=eps), backend)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("eps", group["eps"], low=0.0, low_open=True)

    def _check_mean_sq_norm(self, value: Any) -> Union[float, torch.Tensor]:
        if value is None:
            raise TypeError(
                "FedExP.step() requires mean_sq_norm=: the weighted mean over the round's clients of "
                "their squared update norms ||y_i - x||^2"
            )
        if isinstance(value, torch.Tensor):
            params = self._params_flat
            device = params[0].device if params else torch.device("cpu")
            if value.numel() != 1 or not value.is_floating_point():
                raise ValueError(
                    f"mean_sq_norm must be a number or a one-element floating-point tensor, got "
                    f"{value.dtype} of shape {tuple(value.shape)}"
                )
            if value.device.type != "cpu" and value.device != device:
                raise ValueError(f"mean_sq_norm is on {value.device}; put it on the parameters' device ({device})")
            value = value.detach().reshape(())
            if value.device.type == "cpu":  # a host value: checked without a device sync
                v = float(value)
                if not (v >= 0.0 and math.isfinite(v)):
                    raise ValueError(f"mean_sq_norm must be a finite number >= 0, got {v!r}")
            return value
        return check_number("mean_sq_norm", value, low=0.0)

    def step(  # type: ignore[override]  # mean_sq_norm: the round's input of the step
        self, closure: Optional[Callable[[], float]] = None, *, mean_sq_norm: Any = None
    ) -> Optional[float]:
        """One server step (the formula above); ``mean_sq_norm`` is required, a number or a 0-d tensor on
        the CPU or the parameters' device (read there, without a host sync)."""
        value = self._check_mean_sq_norm(mean_sq_norm)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        key = ("mean_sq_norm", value.data_ptr(), value.dtype) if isinstance(value, torch.Tensor) else value
        with torch.no_grad():
            self._run_after(Prologue(("fedexp",) + (key if isinstance(key, tuple) else (key,)), _fill, (self, value)))
        return loss
