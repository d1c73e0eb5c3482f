"""The project's performance goals, one mechanism for every benchmark: a goal reads figures from a
result and judges each one pass / miss / disturbed / n/a, then the goal as a whole.

A ``Goal`` is a declaration: what it asks (``text``), which figures it is judged on (``where``), the
threshold a figure must reach (``value >= threshold`` passes) and how to read its figures from a
result (``figures``). Each benchmark declares its own (``bench.step_goals`` for the step table,
``bench.clients.goals``, ``bench.loop``) and formats the verdicts in its report.

A figure compares timings taken interleaved in the same rounds (``bench.timing``), so the machine's
load falls on both sides alike. On a CPU, a figure one of whose timings ran while other processes
used more than ``DISTURBED`` cores is judged **disturbed**, not pass or miss: it says nothing
reliable about the goal. A figure that could not be taken (what it compares with was not timed) is
**n/a**. A goal as a whole: **miss** when a quiet figure misses, else **disturbed** when one was
disturbed, else **pass**; **n/a** with the reason when none of its figures was taken or none applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .contention import DISTURBED

# what a verdict is, said above every Goals table: a miss is a figure about this machine, not a failure
INFORMATION = (
    "The project's speed targets, judged on this run's timings: information about this machine, not a test. "
    "A **miss** fails nothing, and the benchmark exits 0 whatever the verdicts (the self-check and the test "
    "suite check correctness)."
)


@dataclass(frozen=True)
class Figure:
    """One figure a goal judges: where it was taken, its value (None: not taken), the cores other
    processes used while each timing it rests on ran (None where unmeasured), and the result row
    it was read from, where there is one."""

    where: str
    value: Optional[float]
    loads: Tuple[Optional[float], ...] = ()
    row: Optional[Dict[str, Any]] = field(default=None, compare=False)


def _plain(value: float) -> str:
    return f"{value:.3g}"


@dataclass(frozen=True)
class Goal:
    """A performance target: ``figures(result)`` -> the figures judged against ``threshold``."""

    key: str  # its short name (a column of the step table)
    text: str  # what it asks
    where: str  # which rows or figures it is judged on
    threshold: float
    figures: Callable[[Any], List[Figure]]
    device: Optional[str] = None  # the device type it is judged on (None: any)
    against: Optional[str] = None  # what its figures compare with (a row's backend, "copy"), for n/a
    show: Callable[[float], str] = _plain  # a figure's value as a report shows it

    def verdict(self, figure: Figure, device_type: str) -> str:
        """'pass', 'miss', 'disturbed' (CPU timings under other processes' load) or 'n/a' (no value)."""
        if figure.value is None:
            return "n/a"
        if device_type == "cpu" and any(c is not None and c > DISTURBED for c in figure.loads):
            return "disturbed"
        return "pass" if figure.value >= self.threshold else "miss"

    def why_no_figure(self, skipped: Dict[str, str]) -> str:
        """Why none of this goal's figures was taken, for its n/a verdict (``skipped``: what the run
        left out on purpose, by name, with the reason)."""
        if self.against is None:
            return "its rows have no figure"
        if self.against in skipped:
            return f"the {self.against} rows were not timed ({skipped[self.against]})"
        return f"no {self.against} row was timed"

    def judge(self, result: Any, device_type: str, skipped: Optional[Dict[str, str]] = None) -> Judged:
        """Each figure of ``result`` judged, and the goal as a whole (module docstring)."""
        judged = [(f, self.verdict(f, device_type)) for f in self.figures(result)]
        taken = [v for _, v in judged if v != "n/a"]
        reason = None
        if not judged:
            verdict, reason = "n/a", f"none of its rows ({self.where}) were run"
        elif not taken:
            verdict, reason = "n/a", self.why_no_figure(skipped or {})
        elif "miss" in taken:
            verdict = "miss"
        elif "disturbed" in taken:
            verdict = "disturbed"
        else:
            verdict = "pass"
        return Judged(self, judged, verdict, reason)


@dataclass
class Judged:
    """A goal's verdicts: one per figure, and the goal's as a whole (with the reason for n/a)."""

    goal: Goal
    figures: List[Tuple[Figure, str]]
    verdict: str
    reason: Optional[str]

    def named(self, verdict: str) -> List[str]:
        """Where each figure with this verdict was taken."""
        return [f.where for f, v in self.figures if v == verdict]

    def count(self, verdict: str) -> int:
        return sum(1 for _, v in self.figures if v == verdict)


def goals_for(goals: List[Goal], device_type: str) -> List[Goal]:
    """The goals judged on a device type."""
    return [g for g in goals if g.device in (None, device_type)]
