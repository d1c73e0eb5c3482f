"""FedDecaySGD and WithinRoundDecay: within-round learning-rate decay (docs/algorithms.md)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..batched.mixin import ClientBatched
from ..core.ops import BATCHED
from ..core.schedules import DecaySchedule, ScheduleLike
from .sgd import SGDFamily


class FedDecaySGD(SGDFamily):
    r"""SGD whose learning rate decays within each FL round (FedDecay).

    From "FedDecay: Adapting to Data Heterogeneity in Federated Learning with Gradient Decay" (Eq. 4-5)
    and its extended version "Balancing Model Performance and Rapid Personalization in Federated
    Learning with Learning Rate Scheduling" (App. B.2; both anonymous submissions under review)::

        lr_k = lr * s(k // decay_every)       k = steps since start_round()
        s(j) = beta ** j                      (schedule="exponential", default)
        s(j) = max(0, 1 - j * (1 - beta))     (schedule="linear")

    then one ``torch.optim.SGD`` step with ``lr_k`` (momentum, dampening, nesterov,
    weight_decay, maximize), plus ``prox_mu * (x - x0)`` (FedProx) and the SCAFFOLD
    ``correction`` given to ``start_round``. ``beta=0`` is FedSGD, ``beta=1`` FedAvg.

    Args:
        params: parameters or param groups.
        lr: base learning rate (read from each param group at every step).
        beta: decay factor in [0, 1] (keyword, required).
        schedule: "exponential", "linear", a callable ``j -> s(j)`` or a 1-D tensor of s(j).
        decay_every: steps per decay period ``j`` (steps per local epoch for per-epoch decay).
        momentum, dampening, nesterov, weight_decay, maximize: as ``torch.optim.SGD``.
        prox_mu: FedProx coefficient (anchor taken at ``start_round``).
        round_decay: the learning rate of round ``t`` is ``lr * round_decay ** t`` (default 1: none;
            ``t`` is ``start_round``'s ``round_index``, docs/algorithms.md).
        backend: "auto", "reference", "triton", "cuda" or "cpu" (docs/backends.md).
        replay: record a GPU step in a CUDA graph and replay it while its launch inputs stay the
            same (docs/replay.md); None: on unless ``FEDOPT_REPLAY=0``.
    """

    schedule: DecaySchedule

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        *,
        beta: float,
        schedule: ScheduleLike = "exponential",
        decay_every: int = 1,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        maximize: bool = False,
        prox_mu: float = 0.0,
        round_decay: float = 1.0,
        backend: str = "auto",
        replay: Optional[bool] = None,
    ):
        self.schedule = DecaySchedule(beta, schedule, decay_every)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            nesterov=nesterov,
            weight_decay=weight_decay,
            maximize=maximize,
            prox_mu=prox_mu,
            round_decay=round_decay,
        )
        super().__init__(params, defaults, backend, replay)


class BatchedFedDecaySGD(ClientBatched, FedDecaySGD):
    """FedDecaySGD for ``C`` stacked clients: ``lr_k = lr * lr_scale[c] * s(k_c // decay_every)``
    per client, then torch.optim.SGD's step per client (FedDecay; SCAFFOLD ``correction`` and
    FedProx ``prox_mu`` as in the per-client optimizer)."""

    _spec = BATCHED["sgd_batched"]

    def current_lr_factor(self) -> List[float]:  # type: ignore[override]  # one factor per client
        """s(k_c // decay_every) of each client's next step."""
        return [self.schedule.factor(k) for k in self.round_step]


class WithinRoundDecay(LRScheduler):
    """FedDecay's within-round schedule as an LR scheduler for any torch optimizer (Adam included).

    Call ``start_round()`` when a round starts and ``step()`` after every ``optimizer.step()``;
    the learning rate of every group is ``base_lr * s(k // decay_every)`` (docs/algorithms.md; FedDecay Eq. 4).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        beta: float,
        schedule: ScheduleLike = "exponential",
        decay_every: int = 1,
        last_epoch: int = -1,
    ):
        self.schedule = DecaySchedule(beta, schedule, decay_every)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[Union[float, torch.Tensor]]:  # a tensor where the base lr is one
        k = max(self.last_epoch, 0)
        return [base * self.schedule.factor(k) for base in self.base_lrs]

    def start_round(self) -> None:
        """Reset k to 0: every group gets its base learning rate back."""
        self.last_epoch = 0
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # in place, as torch's schedulers treat a tensor lr
            else:
                group["lr"] = lr
        self._last_lr = [
            group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            for group in self.optimizer.param_groups
        ]

    def state_dict(self) -> Dict[str, Any]:
        # the schedule (possibly a user callable) is configuration, not state
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "schedule")}
