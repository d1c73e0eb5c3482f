"""FedAdam, FedYogi and FedAdagrad: Reddi et al.'s adaptive server optimizers (docs/algorithms.md)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..core.ops import FEDADAM
from ..core.optimizer import check_number, state_dtype
from ..functional import ADAPTIVE_RULES
from .server import ServerOptimizer


def _check_beta(name: str, value: Any) -> None:
    if check_number(name, value, low=0.0) >= 1.0:
        raise ValueError(f"{name} must lie in [0, 1), got {value!r}")


class AdaptiveServer(ServerOptimizer):
    r"""The three optimizers of "Adaptive Federated Optimization" (Sashank J. Reddi, Zachary Charles,
    Manzil Zaheer, Zachary Garrett, Keith Rush, Jakub Konečný, Sanjiv Kumar, H. Brendan McMahan;
    ICLR 2021), Algorithm 2, on the pseudo-gradient ``g = -Delta`` in ``p.grad``::

        m  = beta1 m + (1 - beta1) g                       (m starts at 0)
        v  = v + g^2                                       (FedAdagrad)
        v  = v - (1 - beta2) g^2 sign(v - g^2)             (FedYogi)
        v  = beta2 v + (1 - beta2) g^2                     (FedAdam)
        x -= lr m / (sqrt(v) + tau)                        (v starts at initial_accumulator_value)

    ``initial_accumulator_value`` is the paper's ``v_{-1} >= tau^2`` (None: ``tau**2``). With
    ``bias_correction=True``, m and v are divided by ``1 - beta^t`` as in torch.optim.Adam (``t``
    the server steps taken, this one included): ``x -= lr/(1-beta1^t) m / (sqrt(v/(1-beta2^t)) + tau)``;
    FedAdagrad's v is a sum, not an average, and takes no correction (only m's applies). Math in
    float32 (float64 for float64 parameters); state ``exp_avg`` (m) and ``exp_avg_sq`` (v) in float32
    (float64), whatever the parameters' dtype. The step count ``t`` is the optimizer's (its
    state_dict's round entry ``k``), not a per-parameter ``step`` entry. Runs op ``fedadam``.
    """

    _spec = FEDADAM
    _rule: str = "adam"
    _state_keys = ("exp_avg", "exp_avg_sq")
    _float32_state = ("exp_avg", "exp_avg_sq")

    def _betas(self, group: Dict[str, Any]) -> Tuple[Any, Any]:
        return group["betas"]

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        if "betas" in group:
            betas = group["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
            _check_beta("betas[0] (beta1)", betas[0])
            _check_beta("betas[1] (beta2)", betas[1])
        else:
            _check_beta("beta1", group["beta1"])
        check_number("tau", group["tau"], low=0.0, low_open=True)
        if group["initial_accumulator_value"] is not None:
            check_number("initial_accumulator_value", group["initial_accumulator_value"], low=0.0)
        if not isinstance(group["bias_correction"], bool):
            raise TypeError(f"bias_correction must be a bool, got {type(group['bias_correction']).__name__}")

    def _hp_row(self, group: Dict[str, Any], t: Optional[int] = None) -> List[float]:
        beta1, beta2 = self._betas(group)
        return [
            float(group["lr"]),
            float(beta1),
            float(beta2),
            float(group["tau"]),
            float(ADAPTIVE_RULES.index(self._rule)),
            float(group["bias_correction"]),
        ]

    def _step_tensors(
        self, p: torch.Tensor, group: Dict[str, Any], state: Dict[str, Any], idx: int
    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
        tensors, override = super()._step_tensors(p, group, state, idx)
        if "exp_avg" not in state:
            dtype = state_dtype(p)
            v0 = group["initial_accumulator_value"]
            v0 = group["tau"] ** 2 if v0 is None else v0
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.full_like(p, float(v0), dtype=dtype, memory_format=torch.preserve_format)
        tensors["exp_avg"] = state["exp_avg"]
        tensors["exp_avg_sq"] = state["exp_avg_sq"]
        return tensors, override


class _WithBetas(AdaptiveServer):
    def __init__(
        self,
        params: Iterable,
        lr: Any = 1e-2,
        betas: Tuple[float, float] = (0.9, 0.99),
        tau: float = 1e-3,
        initial_accumulator_value: Optional[float] = None,
        bias_correction: bool = False,
        *,
        backend: str = "auto",
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            tau=tau,
            initial_accumulator_value=initial_accumulator_value,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults, backend)


class FedAdam(_WithBetas):
    r"""FedAdam: ``v = beta2 v + (1 - beta2) g^2`` (Reddi et al., ICLR 2021, Algorithm 2; the
    formulas of ``AdaptiveServer``). Defaults: lr 1e-2, betas (0.9, 0.99), tau 1e-3, v starts at tau^2,
    no bias correction."""

    _rule = "adam"


class FedYogi(_WithBetas):
    r"""FedYogi: ``v = v - (1 - beta2) g^2 sign(v - g^2)`` (Reddi et al., ICLR 2021, Algorithm 2; the
    formulas of ``AdaptiveServer``). Defaults: lr 1e-2, betas (0.9, 0.99), tau 1e-3, v starts at tau^2,
    no bias correction."""

    _rule = "yogi"


class FedAdagrad(AdaptiveServer):
    r"""FedAdagrad: ``v = v + g^2`` (Reddi et al., ICLR 2021, Algorithm 2; the formulas of
    ``AdaptiveServer``). Defaults: lr 1e-2, beta1 0.9, tau 1e-3, v starts at tau^2, no bias correction
    (with it, only m is corrected: v is a running sum)."""

    _rule = "adagrad"

    def __init__(
        self,
        params: Iterable,
        lr: Any = 1e-2,
        beta1: float = 0.9,
        tau: float = 1e-3,
        initial_accumulator_value: Optional[float] = None,
        bias_correction: bool = False,
        *,
        backend: str = "auto",
    ):
        defaults = dict(
            lr=lr,
            beta1=beta1,
            tau=tau,
            initial_accumulator_value=initial_accumulator_value,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults, backend)

    def _betas(self, group: Dict[str, Any]) -> Tuple[Any, Any]:
        return group["beta1"], 0.0
