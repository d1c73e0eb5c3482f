"""Formulations and clients per chunk chosen on the device that runs them, by measurement.

Every formulation of a client layer computes the same mathematics (each equals per-client autograd
in float64, tests/test_sim_layers_engine.py); which one is fastest depends on the device, its libraries,
the shapes, the number of clients C and the precision. So the engine times them where it runs, as
cuDNN's benchmark mode times its kernels, instead of trusting defaults chosen on another machine:

* Layers are grouped by *signature* (kind, configuration, per-sample input shape, dtype and memory
  format); the layers of one group share one choice (ResNet-18's repeated blocks are measured once).
* Group after group, each candidate (``ClientLayer.candidates``) runs the group's first layer alone,
  forward and backward on the input it gets in the step: one warm-up run each, then ``rounds`` runs
  each in a rotated order, synchronised; medians compared. A candidate replaces the default only
  when it is at least ``margin`` faster: on a noisy machine the default stays rather than flipping
  on noise. A candidate that runs out of memory is dropped.
* A layer alone leaves out what it shares with its neighbours (a grouped run's layout copies), so the
  whole step (forward and backward of the clients' loss, as training runs it) then decides: the
  assembled choice is kept if its step is not slower than the defaults' step, timed the same way;
  else each change is tried alone in the whole step (the largest gain alone first) and kept if the
  step with it is not slower than without.
* The clients computed at once (``--client-batched auto``) are chosen by the step time too: for a
  few equal chunk sizes that fit the device's free memory, largest first, the formulations are
  chosen at that size and the round's time (chunks x step time) compared.

The search spends at most ``SearchBudget.seconds`` (``auto``: ``AUTO_SHARE`` of the run's estimated
training time, the defaults' step time x the run's steps; ``measure``: no limit), predicting each
call before it makes it (``timing.py``); what it could not measure keeps its default, and
``Choice.why`` says so. A run too short for a search to time two candidates and the whole step
within its share (``MIN_SHARE_STEPS``) is not searched at all, and ``Choice.note`` says so.

The search changes speed only: whatever it chooses computes in the run's precision
(``precision.py``: under ``fp32`` every formulation in IEEE float32). A candidate, a whole step, a
compiled step or a chunk size that fails with an error of its own (a library that refuses a shape,
an index past 32 bits, a compiler's failure) is dropped for the run with one warning naming it and
the error (``core/fallbacks.py``); out of memory is dropped silently (``why`` says so). The proven
path's error (the default formulation's, the defaults' step at the only size) is raised.

A choice is kept for the process and, with a cache file (``choice_cache.py``), across runs: the same
signature on the same device, libraries and precision then gets the same formulations, hence the
same bits; a choice whose times spread as on a shared device (``timing.SHARED_SPREAD``) is not
cached. ``default`` skips the search: the fixed defaults, what the search is compared against, at
the largest chunk size whose step runs (one untimed step per size, an out-of-memory recorded).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...core import fallbacks
from .choice_cache import ChoiceCache, step_key
from .layers import FORMULATIONS
from .layers_engine import LayersLoss
from .search import (
    Choice,
    Dropped,
    candidates,
    defaults,
    layer_inputs,
    layer_signature,
    probe_step,
    search,
    time_step,
)
from .timing import MIN_ROUNDS, SHARED_SPREAD, SearchBudget, Timer, out_of_memory

__all__ = ["Chooser", "Choice", "SearchBudget", "Timer", "chunk_sizes", "defaults", "search"]

MODES = ("auto", "default", "measure")
# auto: the search may spend this share of the run's estimated training time
AUTO_SHARE = 0.02
# auto searches only a run whose share is this many step times at least: the defaults' step timed
# (1 + MIN_ROUNDS calls), two candidates of a layer and the whole step with and without a change
# (2 x (1 + MIN_ROUNDS) each); a shorter run keeps the defaults unmeasured
MIN_SHARE_STEPS = 5 * (1 + MIN_ROUNDS)


# ------------------------------------------------------------------ choosing for a run
Inputs = Callable[[int], Tuple[List[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]]
_PROCESS: Dict[str, Dict[str, Any]] = {}  # choices made in this process, by key


def chunk_sizes(sampled: int, fit: int) -> List[int]:
    """Candidate clients per chunk for ``sampled`` clients a round when at most ``fit`` fit at once:
    equal chunks, 1, 2, 4 and 8 times as many as the fewest that fit, largest first."""
    top = max(1, min(sampled, fit))
    first = math.ceil(sampled / top)
    sizes: List[int] = []
    for mult in (1, 2, 4, 8):
        n = math.ceil(sampled / (first * mult))
        if n not in sizes:
            sizes.append(n)
    return sizes


class Chooser:
    """Formulations, and the clients per chunk, for the layers engine ``engine`` in one run.

    ``inputs(C)``: stacked parameters and one step's ``x, y, w`` for C clients (after the model's
    input stage); ``mode``: one of ``MODES``; ``cache``: a ``ChoiceCache`` file (None: this process
    only); ``precision``: the run's (part of the key: it changes which kernels run); ``compile_step``:
    also time the chosen step through ``torch.compile`` (its first run compiles, which can take longer
    than ``auto``'s budget; None: only with ``measure`` on a GPU).
    """

    def __init__(
        self,
        engine: LayersLoss,
        inputs: Inputs,
        mode: str = "auto",
        cache: Optional[ChoiceCache] = None,
        precision: str = "fp32",
        compile_step: Optional[bool] = None,
    ):
        if mode not in MODES:
            raise ValueError(f"formulations must be one of {MODES}, got {mode!r}")
        self.engine, self.inputs, self.mode, self.cache, self.precision = engine, inputs, mode, cache, precision
        self.compile_step = compile_step
        self.choices: Dict[int, Choice] = {}
        self.spent_s = 0.0  # what this run's search took, in all
        self.budget_s: Optional[float] = None  # what it was allowed (None: no limit)
        self.dropped: Dropped = set()  # (signature, formulation) that failed in this run
        self._keys: Dict[int, Tuple[str, Dict[str, Any]]] = {}

    def key(self, params: Sequence[torch.Tensor], x: torch.Tensor) -> Tuple[str, Dict[str, Any]]:
        """The cache key of a step at ``x``'s shape: device, libraries, precision, every layer's
        signature and candidates (one forward pass, once per number of clients)."""
        clients = x.shape[0]
        if clients in self._keys:
            return self._keys[clients]
        inputs = layer_inputs(self.engine, params, x)
        layers = {
            p: {
                "signature": layer_signature(self.engine, p, t),
                "candidates": list(candidates(self.engine.layers_net.layers[p], t)),
            }
            for p, (t, _) in inputs.items()
        }
        order = self.engine.context(x.shape[0], x.shape[1], x.device).order
        key = self._keys[clients] = step_key(x.device, layers, x.shape[0], x.shape[1], order, self.precision)
        return key

    def known(self, clients: int) -> Optional[Choice]:
        """A choice for ``clients`` made before (this run, this process or the cache file), or None."""
        if clients in self.choices:
            return self.choices[clients]
        if self.mode != "auto":
            return None
        params, x, _, _ = self.inputs(clients)
        key, described = self.key(params, x)
        saved, source = _PROCESS.get(key), "process"
        if saved is None and self.cache is not None:
            saved, source = self.cache.get(key, described), "cache"
        if saved is None:
            return None
        choice = self._restore(saved, clients, source)
        if choice is None and self.cache is not None and source == "cache":
            self.cache.reject(key, "names formulations this engine does not have")
        return choice

    def at(self, clients: int, budget: SearchBudget) -> Choice:
        """The choice for ``clients`` at once: made before, the defaults (``default``, or no budget
        left for a search), or measured."""
        choice = self.known(clients)
        if choice is None:
            params, x, y, w = self.inputs(clients)
            if self.mode == "default":
                forms = defaults(self.engine, params, x)
                choice = Choice(clients, forms, {p: "the default (formulations='default')" for p in forms})
            elif not budget.fits(budget.step_s):
                forms = defaults(self.engine, params, x)
                why = "the default; not measured: the search's time budget was spent"
                choice = Choice(clients, forms, {p: why for p in forms}, note="not searched: the budget was spent")
            else:
                compile_step = self.compile_step
                if compile_step is None:
                    compile_step = self.mode == "measure" and x.device.type == "cuda"
                choice = search(self.engine, params, x, y, w, budget, compile_step, self.dropped)
                self.spent_s += choice.spent_s
                self._keep(choice, *self.key(params, x))
        self.choices[clients] = choice
        self.engine.layers_net.set_formulations(choice.formulations)
        return choice

    def _keep(self, choice: Choice, key: str, described: Dict[str, Any]) -> None:
        """Remember a measured choice for the process and, unless its times say the device was shared,
        in the cache file."""
        _PROCESS[key] = choice.to_json()
        if self.cache is None:
            return
        if choice.spread > SHARED_SPREAD:
            choice.note = (
                f"not cached: its timed calls spread by {choice.spread:.0%} of their median (more than "
                f"{SHARED_SPREAD:.0%}: the device was shared while it was measured)"
            )
            return
        self.cache.put(key, described, choice.to_json())

    def _restore(self, saved: Dict[str, Any], clients: int, source: str) -> Optional[Choice]:
        """A saved choice, if it still names a formulation for every layer (else None: measure again)."""
        forms = saved.get("formulations")
        layers = self.engine.layers_net.layers
        if not isinstance(forms, dict) or set(forms) != set(layers):
            return None
        if any(not isinstance(f, str) or f not in FORMULATIONS[layers[p].kind] for p, f in forms.items()):
            return None
        where = "made earlier in this process" if source == "process" else "read from the cache file"
        reasons = saved.get("why")
        if not isinstance(reasons, dict):
            reasons = {}
        why = {p: f"{reasons.get(p, 'measured')} ({where})" for p in forms}
        step = saved.get("step_s")
        step_s = float(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None
        compiled = saved.get("compiled") is True
        return Choice(
            clients,
            dict(forms),
            why,
            step_s,
            source,
            compiled=compiled,
            compile_note=str(saved.get("compile_note", "")),
        )

    def plan(
        self,
        sampled: int,
        fit: int,
        steps_per_run: int,
        fixed: Optional[int] = None,
        budget_s: Optional[float] = None,
    ) -> Tuple[int, Choice]:
        """Clients per chunk and their formulations for a run of ``sampled`` clients a round.

        ``fixed``: the user's number of clients at once (None: choose among ``chunk_sizes(sampled,
        fit)`` by the shortest round, chunks x step time); ``steps_per_run``: local steps of one
        client over the run (rounds x K), which with the default step's time estimates the run's
        training time, of which ``auto`` spends at most ``AUTO_SHARE`` searching (nothing, and the
        defaults, where that share is under ``MIN_SHARE_STEPS`` step times); ``budget_s``: a limit of
        the user's instead (seconds). A chunk size that fails with an error of its own is dropped
        with a warning (the next size is taken); where every size fails, the largest's error is raised."""
        sizes = [fixed] if fixed is not None else chunk_sizes(sampled, fit)
        budget = SearchBudget(budget_s)
        if self.mode == "default":
            n = self._first_that_runs(sizes)
            return n, self.at(n, budget)
        share = None
        if self.mode == "auto" and budget_s is None:
            share = AUTO_SHARE * steps_per_run * math.ceil(sampled / sizes[0])  # the budget in step times
            if share < MIN_SHARE_STEPS:
                choice = self._unsearched(sizes[0], steps_per_run, share)
                self.spent_s = max(self.spent_s, budget.spent)
                return sizes[0], choice
        best: Optional[Tuple[float, int]] = None
        errors: Dict[int, BaseException] = {}
        for n in sizes:
            if best is not None and not budget.fits((1 + MIN_ROUNDS) * (budget.step_s or 0.0)):
                break  # a size not timed cannot be compared: the sizes timed so far decide
            try:
                step_s = self._size(n, budget, share, sampled, steps_per_run, len(sizes) > 1)
            except Exception as exc:  # noqa: BLE001 - this size's own failure; the next size may run
                if len(sizes) == 1:
                    raise
                errors[n] = exc
                if out_of_memory(exc):  # expected while sizes are tried: recorded in the run's results, no warning
                    fallbacks.record(f"{n} clients at once", exc, "fewer clients at once")
                else:
                    fallbacks.fall_back(f"{n} clients at once", exc, "fewer clients at once", stacklevel=4)
                exc.__traceback__ = None
                continue
            if step_s is not None:
                round_s = step_s * math.ceil(sampled / n)
                if best is None or round_s < best[0]:
                    best = (round_s, n)
        self.spent_s = max(self.spent_s, budget.spent)
        self.budget_s = budget.seconds
        ok = [n for n in sizes if n not in errors]
        if not ok:
            raise errors[sizes[0]]
        n = ok[0] if best is None else best[1]
        return n, self.at(n, budget)

    def _first_that_runs(self, sizes: List[int]) -> int:
        """``default``'s clients at once: the largest of ``sizes`` whose step with the defaults runs
        (one untimed step each, largest first; one that runs out of memory is recorded in the run's
        fallbacks and the next taken). The smallest is not tried: nothing is left to fall back to."""
        for n in sizes[:-1]:
            try:
                params, x, y, w = self.inputs(n)
                self.engine.layers_net.set_formulations(defaults(self.engine, params, x))
                self.engine.grads(params, x, y, w)
                return n
            except Exception as exc:  # noqa: BLE001 - out of memory is this size's; another error is raised
                if not out_of_memory(exc):
                    raise
                fallbacks.record(f"{n} clients at once", exc, "fewer clients at once")
                exc.__traceback__ = None
            finally:
                self.engine.layers_net.set_formulations(None)
        return sizes[-1]

    def _size(
        self, n: int, budget: SearchBudget, share: Optional[float], sampled: int, steps: int, timed: bool
    ) -> Optional[float]:
        """The choice at ``n`` clients (``auto``'s budget sized at the first size measured), and its
        step time when sizes are compared (``timed``)."""
        if share is not None and budget.seconds is None and self.known(n) is None:
            params, x, y, w = self.inputs(n)
            t = probe_step(self.engine, params, x, y, w, defaults(self.engine, params, x), budget)
            if t is None:  # the probe knows no budget: only out of memory stops it
                raise torch.OutOfMemoryError(f"{n} clients at once: the defaults' step ran out of memory")
            budget.step_s = t  # the run's estimated training time, at this size
            budget.seconds = AUTO_SHARE * t * math.ceil(sampled / n) * steps
        choice = self.at(n, budget)
        if choice.step_s is None and timed:  # not timed (nothing to choose, or not reached)
            params, x, y, w = self.inputs(n)
            choice.step_s = time_step(self.engine, params, x, y, w, choice.formulations, budget)
        return choice.step_s

    def _unsearched(self, clients: int, steps: int, share: float) -> Choice:
        """The defaults at ``clients``, with nothing measured, looked up or even built (no sample inputs,
        no forward pass): a run too short to search. Its ``formulations`` are empty: each layer takes
        its default at its first call (``ClientLayer.pick``)."""
        note = (
            f"not searched: {AUTO_SHARE:.0%} of a run of {steps} steps is {share:.3g} step times, under the "
            f"{MIN_SHARE_STEPS} a search needs (formulations='measure' searches anyway)"
        )
        choice = Choice(clients, {}, {p: f"the default; {note}" for p in self.engine.layers_net.layers}, note=note)
        self.choices[clients] = choice
        self.engine.layers_net.set_formulations(None)
        return choice
