"""For code that captures steps in a graph of its own and replays them (``sim/batched/trainer_replay.py``).

Such a caller captures whole steps, keeps the plans the capture read, and replays the graph instead
of calling ``step()``. Through these members it learns what a step launches (``step_plans``: every
plan in launch order, a ``Prologue`` where one runs between them), puts the plans back at a round
start with this round's hyperparameter rows written into their hp tensors in place
(``reinstate_plans``: the graph reads those tensors), and tells the optimizer how many steps the
replays took (``note_replayed_steps``). ``replay_stats`` reports the optimizer's own replays
(``replay.py``), its other ops' included.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from .other_ops import OtherOps
from .plan import StepPlan

_COUNTS = ("eager", "recorded", "replayed", "wasted")


class CapturedSteps(OtherOps):
    """``step_plan(s)``, ``reinstate_plan(s)``, ``note_replayed_steps`` and ``replay_stats``."""

    @property
    def step_plan(self) -> Optional[StepPlan]:
        """The plan the next step runs: None before the first step and after anything that drops it
        (a round start, a new param group, ``load_state_dict``)."""
        return self._plan

    def reinstate_plan(self, plan: StepPlan) -> None:
        """Make ``plan`` (this optimizer's, kept by a captured graph) the step's plan again, its
        hyperparameter rows rewritten in place from the current param groups: a graph reading
        ``plan.hp`` then sees this round's values."""
        groups = self._group_inputs(range(len(self.param_groups)))
        host = plan.hp_rows([groups[gi] for gi in range(len(groups))])
        plan.hp.copy_(host)
        self._plan = plan
        self._graph_plan = plan  # a graph reads it: a later round start retires it until reinstated again
        self._hp_cache.keep(host, plan.hp)

    @property
    def step_plans(self) -> Tuple[Any, ...]:
        """Everything the next step launches through a ``fn`` attribute, in launch order: the plans of
        ``_other_ops`` in their declared order, then its own plan; none until each was built.
        FedSAM's: its ascent's plan, its restore (a ``Prologue``), its descent's plan."""
        plan = self._plan
        if plan is None:
            return ()
        others = tuple(self._runners[op.name].plan for op in self._other_ops)
        return () if any(p is None for p in others) else others + (plan,)

    def reinstate_plans(self, plans: Sequence[Any]) -> None:
        """``reinstate_plan`` for what ``step_plans`` returned (a captured step's launches): the first
        plans are the other ops', in order, the last the step's own."""
        for op, plan in zip(self._other_ops, plans, strict=False):
            self._reinstate_op(op.name, plan)
        self.reinstate_plan(plans[-1])

    def note_replayed_steps(self, n: int = 1) -> None:
        """Count ``n`` steps a replay took without ``step()``: the host-side count that sizes the
        decay table and that PAdaMFed's ``local_control`` checks."""
        self._host_steps += n

    def replay_stats(self) -> Dict[str, Any]:
        """How this optimizer's steps ran on a GPU (docs/replay.md): ``eager``, ``recorded`` (a CUDA
        graph made, and replayed for that step), ``replayed`` and ``wasted`` (recordings dropped
        without a replay) launch counts, ``recordings`` held now, and ``on`` / ``off_reason``. The
        launches of ``_other_ops`` count too (a FedSAM step replayed whole counts 2 in ``replayed``)."""
        rep = self._replay
        if rep is None:
            return {
                "on": False,
                "off_reason": "replay=False or FEDOPT_REPLAY=0",
                "eager": 0,
                "recorded": 0,
                "replayed": 0,
                "wasted": 0,
                "recordings": 0,
            }
        out: Dict[str, Any] = {
            "on": rep.off_reason is None,
            "off_reason": rep.off_reason,
            **rep.stats,
            "recordings": len(rep.recordings),
        }
        for runner in self._runners.values():
            other = runner.replay
            if other is None:
                continue
            for key in _COUNTS:
                out[key] += other.stats[key]
            out["recordings"] += len(other.recordings)
            if out["off_reason"] is None and other.off_reason is not None:
                out["on"], out["off_reason"] = False, other.off_reason
        return out
