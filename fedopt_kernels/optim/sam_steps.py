"""FedSAM's ascent launch and its restore of ``x``, as ``optim/fedsam.py`` runs them (docs/replay.md).

The ascent (op ``sam_ascent``) has a step plan, hp rows, counter and launch replay of its own,
kept here as the base class keeps the descent's: built once, reused while nothing changes, so that
an eager step allocates nothing on the device and a step at known addresses replays its recording.
The restore (``x = saved``, bit for bit) is the descent's ``Prologue``: it runs first in the
descent's launch, so that one recording holds the restore and the descent.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from ..core import dtensor as _dtensor
from ..core import replay as _replay
from ..core.optimizer import replayable
from ..core.plan import HpCache, StepPlan, capturing, refuse_in_capture
from ..core.plan_inputs import GroupInputs

SAVED = "saved_x"  # per-parameter state: x before the ascent, restored bit for bit by the descent
_NO_AMP = (False, False)


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
        self.key = _replay.tensors_id(self.xs, self.saved)
        self._plain: Optional[_replay.Prologue] = None
        self._masked: Optional[_replay.Prologue] = None

    def prologue(self, mask: Optional[torch.Tensor]) -> Optional[_replay.Prologue]:
        """The descent's prologue restoring every moved parameter, or only ``mask``'s clients (the
        mask's address is in the descent's key already, as its ``active``). None: nothing moved."""
        if not self.xs:
            return None
        if mask is None:
            pro = self._plain
            if pro is None:
                pro = self._plain = _replay.Prologue(self.key, _copy_all, (self.xs, self.saved))
            return pro
        pro = self._masked
        if pro is None or pro.args[2] is not mask:
            pro = self._masked = _replay.Prologue(self.key, masked_restore, (self.xs, self.saved, mask))
        return pro


class Ascent:
    """The ascent's plan, hp rows, counter and replay (the optimizer builds its plans)."""

    def __init__(self, replay_on: bool):
        self.plan: Optional[StepPlan] = None
        self.hp = HpCache()
        self.k: Dict[torch.device, torch.Tensor] = {}  # the op's own counter (nothing reads it)
        self.replay: Optional[_replay.StepReplay] = _replay.StepReplay() if replay_on else None

    def current(
        self,
        groups: List[Dict[str, Any]],
        group_inputs: Callable[[List[int]], Dict[int, GroupInputs]],
        build: Callable[[], StepPlan],
    ) -> StepPlan:
        """The plan for this step: the last one while it serves (rows rewritten in place after an
        hp edit; ``group_inputs(indexes)``: the edited groups' ``GroupInputs``), else ``build()``'s,
        which keeps the last one's norm scratch."""
        plan = self.plan
        if plan is not None:
            verdict = plan.still_valid(groups)
            if verdict is True or (verdict is not False and plan.update_groups(group_inputs(verdict))):
                return plan
        self.plan = None  # a failed rebuild must not leave the old plan behind
        new = self.plan = build()
        if plan is not None and "scratch" in plan.cache:
            new.cache["scratch"] = plan.cache["scratch"]  # the backend reuses it when big enough
        return new

    def counter(self, device: torch.device, clients: Optional[int]) -> torch.Tensor:
        k = self.k.get(device)
        if k is None:
            refuse_in_capture(device, "create the ascent's step counter on the device")
            k = self.k[device] = torch.zeros(clients or 1, dtype=torch.int32, device=device)
        return k

    def launch(self, plan: StepPlan, k: torch.Tensor, one: torch.Tensor, active: Optional[torch.Tensor]) -> None:
        """The ascent op over ``plan``: replayed, recorded or eager, as the descent (``FedOptimizer._run``)."""
        device = plan.device
        rep = self.replay
        ok = plan.replayable  # decided once per plan
        if ok is None:
            ok = replayable(plan)
        if rep is not None and (not ok or capturing(device)):
            rep = None
        elif rep is not None and rep.off_reason is not None:
            rep.stats["eager"] += 1
            rep = None
        key = None
        if rep is not None:
            key = rep.key(plan, (), plan.hp, k, one, 1, _NO_AMP, active)
            if rep.replay(key):
                return
        cache = plan.cache
        if type(plan) is StepPlan:
            cache["grad_set"] = plan.grad_set  # the backend's own key of the gradients' addresses
        args = (
            plan.params,
            plan.current_grads(),
            plan.lists[SAVED],
            plan.batch,
            plan.present,
            plan.hp,
            k,
            one,
            1,
            None,
            None,
            *((active,) if plan.spec.batched else ()),
            plan.backend,
        )
        if key is None:
            plan.fn(*args, cache=cache)
        else:
            rep.launch(key, device, lambda: plan.fn(*args, cache=cache), cache)  # type: ignore[union-attr]
