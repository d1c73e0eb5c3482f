"""A CUDA graph of the caller's that holds ``step()`` (docs/replay.md, "A whole iteration in one graph").

A graph's replays run the step's kernels without ``step()``: they advance the within-round step
count ``k`` on the device and read the hyperparameter rows the capture saw. What they would compute
wrongly is refused at capture (an LR scheduler stepping a float lr, a decay table that ends too
soon); a plan such a graph reads and the optimizer drops is *retired* (its hp filled with NaN), so
that a stale replay turns the parameters into NaN rather than into plausible numbers.

``Capture`` is what a stepper (``stepper.py``) knows of such a graph; it reads nothing of the
optimizer but what the stepper hands it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from .plan import StepPlan, capturing
from .schedules import DecaySchedule

# plans of retired graphs kept alive (with the tensors their graphs write), the most recent first
RETIRED_GRAPHS = 2


class Capture:
    """The plan a graph of the caller's reads, how many steps of a round its decay table covers, the
    plans retired since, and ``prepare_capture``'s steps per round."""

    def __init__(self) -> None:
        self.plan: Optional[StepPlan] = None  # the plan the graph reads
        self.cover: Optional[int] = None  # steps of a round its decay table covers (None: all)
        self.retired: List[StepPlan] = []
        self.steps_per_round = 0  # prepare_capture's (0: not called)

    def __getstate__(self) -> Dict[str, Any]:
        # a copy holds no graph: the plans stay with the optimizer whose graph reads them
        return {"steps_per_round": self.steps_per_round}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.plan, self.cover, self.retired = None, None, []
        self.steps_per_round = state["steps_per_round"]

    def prepare(self, steps_per_round: int, sched: Optional[DecaySchedule], params: Sequence[torch.Tensor]) -> None:
        """``FedOptimizer.prepare_capture``: the decay table on the device for ``steps_per_round`` steps."""
        if isinstance(steps_per_round, bool) or not isinstance(steps_per_round, int) or steps_per_round < 1:
            raise ValueError(f"steps_per_round must be an integer >= 1, got {steps_per_round!r}")
        if sched is not None and params:
            device = params[0].device
            if capturing(device):
                raise RuntimeError(
                    "prepare_capture() copies the decay table to the device: call it before the capture, not inside it"
                )
            sched.table(device, steps_per_round - 1)
        self.steps_per_round = steps_per_round

    def enter(
        self,
        owner: Any,
        plan: StepPlan,
        sched: Optional[DecaySchedule],
        device: torch.device,
        k_bound: int,
    ) -> None:
        """This step of ``owner`` goes into a CUDA graph the caller is capturing, whose replays will not
        call ``step()``: refuse what they would compute wrongly, and remember the plan they read.
        ``k_bound``: the step calls of this round so far."""
        me = type(owner).__name__
        step = owner.__dict__.get("step")  # an LR scheduler wraps the bound step() of its optimizer
        if getattr(step, "_wrapped_by_lr_sched", False) and any(
            not isinstance(g["lr"], torch.Tensor) for g in owner.param_groups
        ):
            raise RuntimeError(
                f"an LR scheduler steps {me}'s learning rate, a float in param_groups, which the replays of "
                f"a CUDA graph never read (they read the values the capture saw); give the optimizer a "
                f"tensor lr on the parameters' device, e.g. lr=torch.tensor(0.05, device='{device}'): "
                f"the scheduler fills it in place and every replay reads it"
            )
        cover = None
        if sched is not None:
            every = sched.decay_every
            n = sched.length(device)
            if n * every <= max(k_bound, self.steps_per_round - 1) or not (
                sched.constant_after(n) or self.steps_per_round
            ):
                raise RuntimeError(
                    f"{me} reads its within-round decay s(k // decay_every) from a table on the device, "
                    f"and the replays of a CUDA graph advance k without {me} seeing them, so the table "
                    f"must cover every step of the round before the capture (it holds s for the first "
                    f"{n * every} steps): call opt.prepare_capture(steps) with the most steps of a round "
                    f"the graph will take, before capturing"
                )
            cover = None if sched.constant_after(n) else n * every
        self.plan = plan
        self.cover = cover

    def check_round(self, k: Optional[torch.Tensor], t: int, owner: str) -> None:
        """At a round start after a round whose steps a graph of the caller's took with a decay table
        that ends (``cover`` steps): raise once if it took more. Reads the device step count ``k`` (a
        host sync, only after such a round)."""
        cover = self.cover
        if cover is None or k is None:
            return
        self.cover = None
        taken = int(k.max())
        if taken > cover:
            raise RuntimeError(
                f"round {t} of {owner} took {taken} steps, but the decay table of the CUDA "
                f"graph that took them covers {cover}: its steps past {cover} used the table's last "
                f"s instead of s(k // decay_every), so the round's result is wrong. Call "
                f"opt.prepare_capture(steps) with the round's number of steps before capturing (this "
                f"error is raised once; call start_round() again to go on)"
            )

    def retire(self) -> bool:
        """The plan a graph of the caller's read is being dropped (a round start, new param groups or
        state, a rebuilt plan): later replays of that graph would step with tensors and
        hyperparameters the optimizer no longer uses. Its hp tensor is filled with NaN, so that such
        a replay turns the parameters into NaN rather than into plausible numbers, and the plan is
        kept (with the tensors its graph writes) so that the replay writes nowhere else. True when a
        plan was retired: the next plan needs an hp tensor of its own."""
        plan = self.plan
        self.cover = None
        if plan is None:
            return False
        self.plan = None
        plan.hp.fill_(float("nan"))
        self.retired = [plan] + [p for p in self.retired if p is not plan][: RETIRED_GRAPHS - 1]
        return True
