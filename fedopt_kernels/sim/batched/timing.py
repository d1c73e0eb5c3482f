"""How the formulation search times its trials: synchronised calls, interleaved, within a budget.

A *trial* is the whole step (``engine.grads``) under an assignment of formulations, or one layer
alone (its forward and backward on its own input, as in the step). ``Timer.compare`` times a few
options of one decision: one warm-up call each, then rounds of one call each in a rotated order,
medians compared (``choose.py`` decides with them). It keeps to the search's ``SearchBudget``:

* before a call it predicts the call's time (the option's own last time; for an option not timed
  yet, the defaults' step time, ``SearchBudget.step_s``) and makes no call that would not fit;
* a comparison needs ``MIN_ROUNDS`` rounds for its medians: one that cannot have them is not made
  (``Comparison.short``) and its decision keeps the default;

so the search ends within its budget, but for a call that takes longer than predicted.

An option that fails is left out of the answer (``Comparison.failed``): out of memory, or any error
of an option that is not the proven one (the default formulation, the defaults' step), which the
caller drops for the run with a warning. An error of the proven option is raised: training would
meet it too (a bad shape, a model the engine cannot compute).

``Comparison.spread`` is the largest quartile spread of an option's calls over their median: a
device of one's own repeats a call within a few per cent; another process's work between the calls
spreads them by tens of per cent, and such a measurement is not kept in a cache (``SHARED_SPREAD``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .layers_engine import LayersLoss
from .precision import autocast_scope, precision_scope

CLOCK: Callable[[], float] = time.perf_counter  # the search's clock (tests stand in for it)
MARGIN = 0.05
ROUNDS = 5
MIN_ROUNDS = 3  # a median of three calls at least, else the comparison is not made
MIN_CALL_S = 0.05  # a candidate's timed calls last at least this long (more rounds for tiny steps)
MAX_ROUNDS = 25
SHARED_SPREAD = 0.25  # quartile spread / median past which the device is taken to have been shared


class SearchBudget:
    """How long the search may take (seconds from its creation on ``CLOCK``; None: no limit), how it
    compares candidates (``rounds`` timed calls each at least, ``margin`` to replace a choice), and
    ``step_s``: the defaults' step time, what a call not timed yet is predicted to take (None: not
    known, nothing is predicted)."""

    def __init__(self, seconds: Optional[float] = None, rounds: int = ROUNDS, margin: float = MARGIN):
        self.seconds, self.rounds, self.margin = seconds, rounds, margin
        self.step_s: Optional[float] = None
        self.start = CLOCK()

    @property
    def spent(self) -> float:
        return CLOCK() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.spent

    def fits(self, seconds: Optional[float]) -> bool:
        """Would ``seconds`` more (None: a call of unknown length) stay within the budget?"""
        return self.left() >= (0.0 if seconds is None else seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


def _after_failure(device: torch.device) -> None:
    """Give back what a failed call held (its tensors are gone with its frames)."""
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except RuntimeError:  # a device left unusable: the next call says so
            pass


def spread(times: Sequence[float]) -> float:
    """(third quartile - first) / median of ``times`` (0 for fewer than two)."""
    if len(times) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / med if med > 0 else 0.0


@dataclass
class Comparison:
    """What ``Timer.compare`` measured: medians of the options timed to the end, the largest spread
    among them, the options that failed (and their error), and whether the budget cut it short."""

    times: Dict[str, float] = field(default_factory=dict)
    spread: float = 0.0
    failed: Dict[str, BaseException] = field(default_factory=dict)
    short: bool = False


Trial = Tuple[str, ...]  # ("step", <assignment key>) or ("alone", path, formulation)


class Timer:
    """Times trials on fixed inputs (module docstring)."""

    def __init__(self, engine: LayersLoss, params: Sequence[torch.Tensor], x, y, w, budget: SearchBudget):
        self.engine, self.params, self.x, self.y, self.w = engine, list(params), x, y, w
        self.device = x.device
        self.budget = budget
        self.assignments: Dict[str, Dict[str, str]] = {}
        self.inputs: Dict[str, Tuple[torch.Tensor, bool]] = {}  # layer path -> (its input, needs a gradient)

    def measure(self, trial: Trial) -> float:
        """Seconds one run of ``trial`` takes, synchronised."""
        _sync(self.device)
        t0 = CLOCK()
        if trial[0] == "step":
            self.engine.layers_net.set_formulations(self.assignments[trial[1]])
            self.engine.grads(self.params, self.x, self.y, self.w)
        else:
            self._alone(trial[1], trial[2])
        _sync(self.device)
        return CLOCK() - t0

    def _alone(self, path: str, form: str) -> None:
        net = self.engine.layers_net
        layer = net.layers[path]
        x, needs_grad = self.inputs[path]
        x = x.detach().requires_grad_(needs_grad)
        ps = {a: t.detach().requires_grad_() for (m, a), t in zip(net.slots, self.params, strict=True) if m is layer}
        saved = layer.formulation
        layer.formulation, layer.params = form, ps
        layer.ctx = self.engine.context(self.x.shape[0], self.x.shape[1], self.device)
        prec, dev = self.engine.precision, self.device
        try:  # as in the step: the forward under the run's precision and autocast, the backward outside autocast
            with torch.enable_grad(), precision_scope(prec, dev):
                with autocast_scope(prec, dev):
                    out = layer(x)
                    out = out[0] if isinstance(out, tuple) else out
                out.backward(torch.ones_like(out))
        finally:
            layer.formulation, layer.params = saved, {}

    def _call(self, name: str, trial: Trial, proven: Optional[str], out: Comparison) -> Optional[float]:
        """One call of an option; None when it failed (then ``out.failed`` says why)."""
        try:
            return self.measure(trial)
        except Exception as exc:  # noqa: BLE001 - sorted: the proven option's error is the caller's
            if name == proven and not out_of_memory(exc):
                raise
            exc.__traceback__ = None  # its frames hold the call's tensors
            out.failed[name] = exc
            _after_failure(self.device)
            return None

    def compare(self, options: Dict[str, Trial], proven: Optional[str] = None, probe: bool = False) -> Comparison:
        """Each option's median seconds (module docstring); ``proven``: the option whose error is
        raised, not dropped; ``probe``: exactly ``MIN_ROUNDS`` rounds (the budget is not known yet)."""
        out = Comparison()
        budget = self.budget
        last: Dict[str, float] = {}
        for name, trial in options.items():  # the warm-up call: allocations, library autotuning
            # an option not timed yet: as long as the slowest warm-up so far, or the defaults' step
            if not budget.fits(max(last.values()) if last else budget.step_s):
                out.short = True
                return out
            t = self._call(name, trial, proven, out)
            if t is not None:
                last[name] = t
        times: Dict[str, List[float]] = {n: [] for n in last}
        r = 0
        while last and r < (MIN_ROUNDS if probe else MAX_ROUNDS):
            if not budget.fits(sum(last.values())):
                break
            names = list(last)
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                t = self._call(name, options[name], proven, out)
                if t is None:
                    del last[name], times[name]
                else:
                    last[name] = t
                    times[name].append(t)
            r += 1
            if r >= max(budget.rounds, MIN_ROUNDS) and times and min(sum(t) for t in times.values()) >= MIN_CALL_S:
                break
        if last and r < MIN_ROUNDS:
            out.short = True
            return out
        out.times = {n: statistics.median(t) for n, t in times.items() if t}
        out.spread = max((spread(t) for t in times.values()), default=0.0)
        return out

    def steps(self, assignments: Dict[str, Dict[str, str]], proven: Optional[str] = None) -> Comparison:
        """``compare`` of whole steps, one per named assignment."""
        self.assignments.update(assignments)
        return self.compare({name: ("step", name) for name in assignments}, proven)
