"""Within-round learning-rate decay schedules s(j) of FedDecay (docs/algorithms.md).

``lr_k = lr * s(k // decay_every)`` where ``k`` counts steps since ``start_round``.

* ``"exponential"``: ``s(j) = beta ** j`` (FedDecay, Eq. 4; ``0 ** 0 == 1``)
* ``"linear"``: ``s(j) = max(0, 1 - j * (1 - beta))`` (FedDecay's extended version, App. B.2)
* a callable ``j -> float`` (non-increasing, ``s(0) > 0``), evaluated on the host once per distinct j
* a 1-D tensor of length >= the number of distinct j used in a round (finite, non-negative,
  non-increasing, ``s(0) > 0``: checked when the schedule is created)
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Union

import torch

ScheduleLike = Union[str, Callable[[int], float], torch.Tensor]

# Built-in schedules are tabulated this far ahead so a CUDA graph of many steps never reads
# past the table; the table grows (on the host, between steps) if a round goes longer.
_PREFILL = 1024


def _check_beta(beta: float) -> float:
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not (0.0 <= float(beta) <= 1.0):
        raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
    return float(beta)


class DecaySchedule:
    """s(j) on the host (``value``) and as a float64 table on any device (``table``)."""

    def __init__(self, beta: float = 1.0, schedule: ScheduleLike = "exponential", decay_every: int = 1):
        if isinstance(decay_every, bool) or not isinstance(decay_every, int) or decay_every < 1:
            raise ValueError(f"decay_every must be an integer >= 1, got {decay_every!r}")
        self.decay_every = decay_every
        self.beta = _check_beta(beta)
        self._values: List[float] = []
        self._tables: Dict[torch.device, torch.Tensor] = {}
        self._fn: Optional[Callable[[int], float]] = None  # kind "callable" only
        if isinstance(schedule, torch.Tensor):
            if schedule.dim() != 1 or schedule.numel() == 0 or schedule.is_complex():
                raise ValueError(f"schedule tensor must be 1-D, real and non-empty, got shape {tuple(schedule.shape)}")
            self.kind = "tensor"
            self._fn = None
            self._host = [float(v) for v in schedule.detach().double().cpu().tolist()]
            for j, v in enumerate(self._host):
                if not math.isfinite(v) or v < 0:
                    raise ValueError(f"schedule tensor has s({j}) = {v!r}; every value must be finite and >= 0")
        elif callable(schedule):
            self.kind = "callable"
            self._fn = schedule
        elif schedule in ("exponential", "linear"):
            self.kind = schedule
            self._fn = None
        else:
            raise ValueError(f"schedule must be 'exponential', 'linear', a callable or a 1-D tensor, got {schedule!r}")
        if self.kind == "tensor":
            self._extend(len(self._host) - 1)
        if self.value(0) <= 0:
            raise ValueError(f"schedule must have s(0) > 0, got s(0) = {self.value(0)!r}")

    def _compute(self, j: int) -> float:
        if self.kind == "exponential":
            return self.beta**j  # Python: 0.0 ** 0 == 1.0
        if self.kind == "linear":
            return max(0.0, 1.0 - j * (1.0 - self.beta))
        if self.kind == "tensor":
            if j >= len(self._host):
                raise ValueError(
                    f"schedule tensor has length {len(self._host)} but step needs s({j}); "
                    f"give a schedule at least as long as the round's number of decay periods"
                )
            return self._host[j]
        assert self._fn is not None  # kind == "callable": the other kinds returned above
        v = float(self._fn(j))
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"schedule callable returned s({j}) = {v!r}; it must be finite and >= 0")
        return v

    def _extend(self, j: int) -> None:
        while len(self._values) <= j:
            n = len(self._values)
            v = self._compute(n)
            if n > 0 and v > self._values[-1]:
                raise ValueError(f"schedule must be non-increasing, got s({n}) = {v} > s({n - 1}) = {self._values[-1]}")
            self._values.append(v)

    def value(self, j: int) -> float:
        """s(j), evaluated once per distinct j."""
        self._extend(j)
        return self._values[j]

    def factor(self, k: int) -> float:
        """s(k // decay_every) for within-round step k."""
        return self.value(k // self.decay_every)

    def length(self, device: torch.device) -> int:
        """Entries of the table on ``device`` (0 when none was made there)."""
        tab = self._tables.get(torch.device(device))
        return 0 if tab is None else tab.numel()

    def constant_after(self, n: int) -> bool:
        """Is ``s(j) == s(n - 1)`` for every ``j >= n``, so that a table of ``n`` entries, whose last
        entry the kernels read past its end, is exact for every step? For a built-in schedule with
        ``beta = 1`` (s = 1), and for any schedule with ``s(n - 1) == 0`` (non-increasing and
        non-negative, it stays 0), except a tensor schedule: a step past its length is an error."""
        if self.kind == "tensor" or n < 1:
            return False
        if self.kind in ("exponential", "linear") and self.beta == 1.0:
            return True
        return self.value(n - 1) == 0.0

    def table(self, device: torch.device, k: int) -> torch.Tensor:
        """float64 tensor [s(0), ..., s(J)] on ``device`` with J >= k // decay_every."""
        j = k // self.decay_every
        tab = self._tables.get(device)
        if tab is not None and tab.numel() > j:
            return tab  # the per-step path: no device normalisation, no host work
        dev = torch.device(device)
        tab = self._tables.get(dev)
        if tab is None or tab.numel() <= j:
            if self.kind in ("exponential", "linear"):
                want = max(j, 2 * (0 if tab is None else tab.numel()), _PREFILL - 1)
            else:
                want = max(j, len(self._values) - 1)
            self._extend(want)
            tab = torch.tensor(self._values[: want + 1], dtype=torch.float64)
            if dev.type == "cuda":
                # pinned + non_blocking: a pageable host-to-device copy would synchronise inside step()
                tab = tab.pin_memory().to(dev, non_blocking=True)
            else:
                tab = tab.to(dev)
            self._tables[dev] = tab
        return tab

    def __repr__(self) -> str:
        return f"DecaySchedule(kind={self.kind!r}, beta={self.beta}, decay_every={self.decay_every})"
