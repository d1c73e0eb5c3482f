"""FedSAM's restore of ``x`` and its pending first step, as ``optim/fedsam.py`` runs them (docs/replay.md).

The ascent (op ``sam_ascent``) is one of the optimizer's other ops (``core/stepper.py``): the base
class builds, keeps and replays its plan. The restore (``x = saved``, bit for bit) is the descent's
``Prologue``: it runs first in the descent's launch, so that one recording holds the restore and
the descent.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch

from ..core import dtensor as _dtensor
from ..core.optimizer import Prologue, StepPlan, tensors_id

SAVED = "saved_x"  # per-parameter state: x before the ascent, restored bit for bit by the descent


class Pending(NamedTuple):
    """A first step waiting for its second: the flat indexes it moved, its plan (None after a
    ``load_state_dict``) and the client mask it took (client-batched form)."""

    order: Sequence[int]
    plan: Optional[StepPlan]
    mask: Optional[torch.Tensor]


def masked_restore(xs: List[torch.Tensor], saved: List[torch.Tensor], mask: torch.Tensor) -> None:
    """``x = saved`` for the clients ``mask`` marks (``[C]`` bools), in place, allocating nothing."""
    views: Dict[int, torch.Tensor] = {}
    for x, s in zip(xs, saved, strict=True):
        m = views.get(x.dim())
        if m is None:
            m = views[x.dim()] = mask.view((-1,) + (1,) * (x.dim() - 1))
        torch.where(m, s, x, out=x)


def _copy_all(xs: List[torch.Tensor], saved: List[torch.Tensor]) -> None:
    torch._foreach_copy_(xs, saved)


class Restore:
    """The restore's tensors for one set of moved parameters, worked out once (no per-step walk)."""

    def __init__(self, source: Optional[StepPlan], params: List[torch.Tensor], state: Dict[Any, Any], order):
        self.source = source
        ps = [params[i] for i in order]
        # element by element on the local tensors: a sharded parameter restores its own shard
        self.xs = [_dtensor.local(p) for p in ps]
        self.saved = [_dtensor.local(state[p][SAVED]) for p in ps]
        self.key = tensors_id(self.xs, self.saved)
        self._plain: Optional[Prologue] = None
        self._masked: Optional[Prologue] = None

    def prologue(self, mask: Optional[torch.Tensor]) -> Optional[Prologue]:
        """The descent's prologue restoring every moved parameter, or only ``mask``'s clients (the
        mask's address is in the descent's key already, as its ``active``). None: nothing moved."""
        if not self.xs:
            return None
        if mask is None:
            pro = self._plain
            if pro is None:
                pro = self._plain = Prologue(self.key, _copy_all, (self.xs, self.saved))
            return pro
        pro = self._masked
        if pro is None or pro.args[2] is not mask:
            pro = self._masked = Prologue(self.key, masked_restore, (self.xs, self.saved, mask))
        return pro
