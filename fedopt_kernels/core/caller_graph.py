"""A CUDA graph of the caller's that holds ``step()`` (docs/replay.md, "A whole iteration in one graph").

A graph's replays run the step's kernels without ``step()``: they advance the within-round step
counter on the device and read the hyperparameter rows the capture saw. What they would compute
wrongly is refused at capture (an LR scheduler stepping a float lr, a decay table that ends too
soon); a plan such a graph reads and the optimizer drops is *retired* (its hp filled with NaN), so
that a stale replay turns the parameters into NaN rather than into plausible numbers.
"""

from __future__ import annotations

from typing import Optional

import torch

from .algorithm_hooks import AlgorithmHooks
from .plan import HpCache, StepPlan, capturing
from .schedules import DecaySchedule

# plans of retired graphs kept alive (with the tensors their graphs write), the most recent first
RETIRED_GRAPHS = 2


class CallerGraph(AlgorithmHooks):
    """``prepare_capture`` and the checks around a graph of the caller's."""

    def prepare_capture(self, steps_per_round: int) -> None:
        """Ready what a CUDA graph holding ``step()`` reads for the first ``steps_per_round`` steps of
        a round. A graph's replays advance the within-round step counter ``k`` on the device without
        the optimizer seeing them, so a table the kernels index by ``k`` must be complete before the
        capture: FedDecaySGD's ``s(k // decay_every)`` is tabulated here for every ``k <
        steps_per_round`` (the other optimizers read no such table). A capture that needs it and
        was not prepared is refused (docs/replay.md, "A whole iteration in one graph")."""
        if isinstance(steps_per_round, bool) or not isinstance(steps_per_round, int) or steps_per_round < 1:
            raise ValueError(f"steps_per_round must be an integer >= 1, got {steps_per_round!r}")
        sched = self._schedule()
        params = self._params_flat
        if sched is not None and params:
            device = params[0].device
            if capturing(device):
                raise RuntimeError(
                    "prepare_capture() copies the decay table to the device: call it before the capture, not inside it"
                )
            sched.table(device, steps_per_round - 1)
        self._capture_steps = steps_per_round

    def _enter_capture(self, plan: StepPlan, sched: Optional[DecaySchedule], device: torch.device) -> None:
        """This step goes into a CUDA graph the caller is capturing, whose replays will not call
        ``step()``: refuse what they would compute wrongly, and remember the plan they read."""
        me = type(self).__name__
        step = self.__dict__.get("step")  # an LR scheduler wraps the bound step() of its optimizer
        if getattr(step, "_wrapped_by_lr_sched", False) and any(
            not isinstance(g["lr"], torch.Tensor) for g in self.param_groups
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
            if n * every <= max(self._host_steps, self._capture_steps - 1) or not (
                sched.constant_after(n) or self._capture_steps
            ):
                raise RuntimeError(
                    f"{me} reads its within-round decay s(k // decay_every) from a table on the device, "
                    f"and the replays of a CUDA graph advance k without {me} seeing them, so the table "
                    f"must cover every step of the round before the capture (it holds s for the first "
                    f"{n * every} steps): call opt.prepare_capture(steps) with the most steps of a round "
                    f"the graph will take, before capturing"
                )
            cover = None if sched.constant_after(n) else n * every
        self._graph_plan = plan
        self._graph_cover = cover

    def _check_graph_round(self) -> None:
        """At a round start after a round whose steps a graph of the caller's took with a decay
        table that ends (``_graph_cover`` steps): raise once if it took more. Reads the device step
        counter (a host sync, only after such a round)."""
        cover = self._graph_cover
        if cover is None or self._k_dev is None:
            return
        self._graph_cover = None
        k = int(self._k_dev.max())
        if k > cover:
            raise RuntimeError(
                f"round {self._t} of {type(self).__name__} took {k} steps, but the decay table of the CUDA "
                f"graph that took them covers {cover}: its steps past {cover} used the table's last "
                f"s instead of s(k // decay_every), so the round's result is wrong. Call "
                f"opt.prepare_capture(steps) with the round's number of steps before capturing (this "
                f"error is raised once; call start_round() again to go on)"
            )

    def _retire_graph(self) -> None:
        """The plan a graph of the caller's read is being dropped (a round start, new param groups or
        state, a rebuilt plan): later replays of that graph would step with tensors and
        hyperparameters the optimizer no longer uses. Its hp tensor is filled with NaN, so that such
        a replay turns the parameters into NaN rather than into plausible numbers, and the plan is
        kept (with the tensors its graph writes) so that the replay writes nowhere else; the next
        plan gets an hp tensor of its own."""
        plan = self._graph_plan
        self._graph_cover = None
        if plan is None:
            return
        self._graph_plan = None
        plan.hp.fill_(float("nan"))
        self._retired = [plan] + [p for p in self._retired if p is not plan][: RETIRED_GRAPHS - 1]
        self._hp_cache = HpCache()
