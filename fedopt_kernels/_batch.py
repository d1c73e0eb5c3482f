"""What an optimizer hands to a backend: the kernel-facing interface shared by every backend.

A backend implementation of an op is ``fn(groups: list[Group], ctx: StepContext) -> None``. It
updates ``group.params`` (and the tensors in ``group.tensors`` that the op writes) in place.

Every ``Group`` is *uniform*: all its lists have one tensor per parameter (never None), so a
kernel never branches per tensor on "is there a momentum buffer / scale / correction here". The
optimizer splits a param group into several ``Group`` objects when that is not so (e.g. a
NeuronLRSGD group where only the weights have neuron scales).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .schedules import DecaySchedule


@dataclass
class Group:
    """Parameters that share hyperparameters and the same set of per-tensor inputs.

    ``hp``: floats and bools from the param group plus values the optimizer derived for this step
    (documented per op in ``fedopt_kernels/reference/``). ``tensors``: name -> list aligned with
    ``params`` (e.g. ``"momentum_buffer"``, ``"x0"``, ``"correction"``, ``"neuron_scale"``).
    """

    params: List[torch.Tensor]
    grads: List[torch.Tensor]
    hp: Dict[str, Any]
    tensors: Dict[str, List[torch.Tensor]] = field(default_factory=dict)


class StepContext:
    """Per-step values shared by all groups of one ``step()``.

    ``k``/``t`` are the host's within-round step index and round index. Fused backends must not
    read them to compute per-step scalars (that would bake them into a captured CUDA graph):
    they use ``k_device(device)`` (an int32 tensor of shape [1] holding ``k``, advanced on the
    device after every step) and ``schedule_table(device)`` instead.
    """

    def __init__(self, k: int, t: int, schedule: Optional[DecaySchedule], counters: "DeviceCounters"):
        self.k = k
        self.t = t
        self.schedule = schedule
        self._counters = counters

    def lr_factor(self) -> float:
        """Host value of s(k // decay_every) (1.0 without a schedule): for the reference backend."""
        return 1.0 if self.schedule is None else self.schedule.factor(self.k)

    def k_device(self, device: torch.device) -> torch.Tensor:
        """int32 tensor [1] on ``device`` holding this step's within-round index ``k``."""
        return self._counters.get(device, self.k)

    def schedule_table(self, device: torch.device) -> torch.Tensor:
        """float64 tensor of s(0), s(1), ... on ``device``, long enough for this step.

        Kernels read ``table[min(k // decay_every, len(table) - 1)]``; without a schedule it is [1.0].
        """
        if self.schedule is None:
            return self._counters.ones(device)
        return self.schedule.table(device, self.k)

    @property
    def decay_every(self) -> int:
        return 1 if self.schedule is None else self.schedule.decay_every


class DeviceCounters:
    """The within-round step counter kept on each device that a fused backend asked for.

    Created lazily (a reference run never allocates one), reset by ``start_round`` and advanced by
    one on the device after every step, so no step ever reads it back to the host.
    """

    def __init__(self) -> None:
        self._k: Dict[torch.device, torch.Tensor] = {}
        self._ones: Dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, k: int) -> torch.Tensor:
        dev = torch.device(device)
        if dev not in self._k:
            self._k[dev] = torch.full((1,), k, dtype=torch.int32, device=dev)
        return self._k[dev]

    def ones(self, device: torch.device) -> torch.Tensor:
        dev = torch.device(device)
        if dev not in self._ones:
            self._ones[dev] = torch.ones(1, dtype=torch.float64, device=dev)
        return self._ones[dev]

    def advance(self) -> None:
        for k in self._k.values():
            k.add_(1)

    def reset(self) -> None:
        for k in self._k.values():
            k.zero_()

    def forget(self) -> None:
        """Drop the device copies (after load_state_dict they are rebuilt from the host value)."""
        self._k.clear()
