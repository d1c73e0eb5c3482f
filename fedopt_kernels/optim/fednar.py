"""FedNAR: co-clipping of gradient and weight decay (docs/algorithms.md)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

from ..batched.mixin import ClientBatched
from ..core.ops import BATCHED, FEDNAR
from ..core.optimizer import FedOptimizer, check_number


class FedNAR(FedOptimizer):
    r"""Co-clipping of gradient and weight decay, annealed per round (FedNAR).

    From "FedNAR: Federated Optimization with Normalized Annealing Regularization" (Junbo Li, Ang Li,
    Chong Tian, Qirong Ho, Eric P. Xing, Hongyi Wang; NeurIPS 2023), Eq. 3-4 and Alg. 2. With ``t``
    the round index (``start_round(round_index=t)``; ``l_t`` is the round decay every optimizer of
    the package takes, here with the paper's default 0.998)::

        l_t  = lr * round_decay ** t
        d    = g + weight_decay * x + correction + prox_mu * (x - x0)
        s    = || d ||_2 over all parameters of the optimizer (all groups; squares summed in float64)
        coef = min(1, max_norm / (s + eps))          (torch clip_grad_norm_ semantics)
        x   -= l_t * coef * d

    i.e. the paper's ``lambda = l_t * coef`` and ``mu = l_t * weight_decay * coef``; the update
    norm never exceeds ``l_t * max_norm``. Run it on FedAvg (default), FedProx (``prox_mu``) or
    SCAFFOLD (``start_round(correction=...)``).
    """

    _spec = FEDNAR

    def __init__(
        self,
        params: Iterable,
        lr: float,
        weight_decay: float,
        max_norm: float = 10.0,
        round_decay: float = 0.998,
        eps: float = 1e-6,
        prox_mu: float = 0.0,
        backend: str = "auto",
        replay: Optional[bool] = None,
    ):
        defaults = dict(
            lr=lr, weight_decay=weight_decay, max_norm=max_norm, round_decay=round_decay, eps=eps, prox_mu=prox_mu
        )
        super().__init__(params, defaults, backend, replay)

    def _validate_group(self, group: Dict[str, Any]) -> None:
        super()._validate_group(group)
        check_number("weight_decay", group["weight_decay"], low=0.0)
        check_number("max_norm", group["max_norm"], low=0.0, low_open=True)
        check_number("eps", group["eps"], low=0.0)


class BatchedFedNAR(ClientBatched, FedNAR):
    """FedNAR for ``C`` stacked clients: each client clips its own ``d`` by its own global norm
    (over all of that client's tensors), with ``l_t = lr * lr_scale[c] * round_decay ** t_c``."""

    _spec = BATCHED["fednar_batched"]
