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

The search spends at most ``SearchBudget.seconds`` (``auto``: a share of the run's estimated training
time; ``measure``: no limit); what it could not measure keeps its default, and ``Choice.why`` says
so. A choice is kept for the process and, with a cache file (``choice_cache.py``), across runs: the
same signature on the same device and torch then gets the same formulations, hence the same bits.
``default`` skips the search: the fixed defaults, what the search is compared against.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .choice_cache import ChoiceCache, step_key
from .compiled import CompiledLayersLoss, NotCompilable
from .layers import FORMULATIONS, ClientLayer
from .layers_engine import LayersLoss
from .precision import autocast_scope, precision_scope

MODES = ("auto", "default", "measure")
# auto: the search may spend this share of the run's estimated training time
AUTO_SHARE = 0.02
MARGIN = 0.05
ROUNDS = 5
MIN_CALL_S = 0.05  # a candidate's timed calls last at least this long (more rounds for tiny steps)
MAX_ROUNDS = 25


class SearchBudget:
    """How long the search may take (wall-clock seconds from its creation; None: no limit), and
    how it compares candidates: ``rounds`` timed calls each at least, ``margin`` to replace a choice."""

    def __init__(self, seconds: Optional[float] = None, rounds: int = ROUNDS, margin: float = MARGIN):
        self.seconds, self.rounds, self.margin = seconds, rounds, margin
        self.start = time.perf_counter()

    @property
    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.spent


@dataclass
class Choice:
    """The formulations chosen for C clients: module path -> formulation, and why each."""

    clients: int
    formulations: Dict[str, str]
    why: Dict[str, str]
    step_s: Optional[float] = None  # median time of one step with these formulations (None: not timed)
    source: str = "default"  # default | measured | process | cache
    spent_s: float = 0.0  # what finding it cost (0 when it came from a cache)
    times_s: Dict[str, Dict[str, float]] = field(default_factory=dict)  # group -> candidate -> median
    compiled: bool = False  # the step runs through torch.compile (CompiledLayersLoss)
    compile_note: str = ""  # whether torch.compile was tried, and what it measured

    def to_json(self) -> Dict[str, Any]:
        return {
            "clients": self.clients,
            "compiled": self.compiled,
            "compile_note": self.compile_note,
            "formulations": dict(self.formulations),
            "why": dict(self.why),
            "step_s": self.step_s,
            "times_s": {g: dict(t) for g, t in self.times_s.items()},
        }


# ------------------------------------------------------------------ signatures
def layer_inputs(
    engine: LayersLoss, params: Sequence[torch.Tensor], x: torch.Tensor
) -> Dict[str, Tuple[torch.Tensor, bool]]:
    """Each client layer's input in one forward pass of the clients' samples ``x`` [C, B, ...]
    (detached), and whether training takes its gradient: what the layer's candidates, signature and
    time alone depend on."""
    seen: Dict[str, Tuple[torch.Tensor, bool]] = {}
    hooks = []
    for path, layer in engine.layers_net.layers.items():

        def keep(m: Any, args: tuple, path: str = path) -> None:
            seen.setdefault(path, (args[0].detach(), args[0].requires_grad))

        hooks.append(layer.register_forward_pre_hook(keep))
    leaves = [p.detach().requires_grad_() for p in params]
    try:
        with torch.enable_grad():
            engine.logits(leaves, x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def candidates(layer: ClientLayer, x: torch.Tensor) -> Tuple[str, ...]:
    """The formulations that compute ``layer`` on an input like ``x`` (``ClientLayer.candidates``)."""
    return tuple(layer.candidates(x))


def layer_signature(engine: LayersLoss, path: str, x: torch.Tensor) -> str:
    """Kind, configuration (the source module's ``extra_repr``), per-sample input and its layout."""
    src = engine.layers_net.source.get_submodule(path)
    layout = "nhwc" if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) else "dense"
    dtype = str(x.dtype).replace("torch.", "")
    return f"{type(src).__name__}({src.extra_repr()}) in {list(x.shape[1:])} {dtype} {layout}"


def groups_of(engine: LayersLoss, inputs: Dict[str, torch.Tensor]) -> Dict[str, List[str]]:
    """Signature -> the layer paths that have it (forward order), for layers with a choice to make."""
    out: Dict[str, List[str]] = {}
    for path, layer in engine.layers_net.layers.items():
        x = inputs.get(path)
        if x is None or len(candidates(layer, x)) < 2:
            continue
        out.setdefault(layer_signature(engine, path, x), []).append(path)
    return out


# ------------------------------------------------------------------ timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


Trial = Tuple[str, ...]  # ("step", <assignment key>) or ("alone", path, formulation)


class Timer:
    """Times trials on fixed inputs: the whole step (``engine.grads``) under an assignment of
    formulations, or one layer alone (its forward and backward on its own input, as in the step)."""

    def __init__(self, engine: LayersLoss, params: Sequence[torch.Tensor], x, y, w, budget: SearchBudget):
        self.engine, self.params, self.x, self.y, self.w = engine, list(params), x, y, w
        self.device = x.device
        self.budget = budget
        self.assignments: Dict[str, Dict[str, str]] = {}
        self.inputs: Dict[str, Tuple[torch.Tensor, bool]] = {}  # layer path -> (its input, needs a gradient)

    def measure(self, trial: Trial) -> float:
        """Seconds one run of ``trial`` takes, synchronised."""
        _sync(self.device)
        t0 = time.perf_counter()
        if trial[0] == "step":
            self.engine.layers_net.set_formulations(self.assignments[trial[1]])
            self.engine.grads(self.params, self.x, self.y, self.w)
        else:
            self._alone(trial[1], trial[2])
        _sync(self.device)
        return time.perf_counter() - t0

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

    def compare(self, options: Dict[str, Trial]) -> Dict[str, float]:
        """Median seconds of each option's trial, interleaved (rotated order each round) after one
        warm-up run each; an option that runs out of memory is left out of the answer."""
        live: Dict[str, Trial] = {}
        for name, trial in options.items():  # the warm-up run: allocations, library autotuning
            try:
                self.measure(trial)
                live[name] = trial
            except RuntimeError as exc:
                if not _out_of_memory(exc):
                    raise
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        times: Dict[str, List[float]] = {n: [] for n in live}
        names = list(live)
        r = 0
        while names and r < MAX_ROUNDS:
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(self.measure(live[name]))
            r += 1
            if r >= self.budget.rounds and min(sum(t) for t in times.values()) >= MIN_CALL_S:
                break
            if self.budget.left() <= 0 and r >= 2:
                break
        return {n: statistics.median(t) for n, t in times.items() if t}

    def steps(self, assignments: Dict[str, Dict[str, str]]) -> Dict[str, float]:
        """``compare`` of whole steps, one per named assignment."""
        self.assignments.update(assignments)
        return self.compare({name: ("step", name) for name in assignments})


# ------------------------------------------------------------------ the search
def defaults(engine: LayersLoss, params: Sequence[torch.Tensor], x: torch.Tensor) -> Dict[str, str]:
    """The fixed default formulation of every client layer at this input (one forward pass)."""
    engine.layers_net.set_formulations(None)
    with torch.no_grad():
        engine.logits(params, x)
    return dict(engine.layers_net.formulations())


def _ms(times: Dict[str, float]) -> str:
    return ", ".join(f"{f} {times[f] * 1e3:.3g} ms" for f in sorted(times, key=lambda f: times[f]))


def search(
    engine: LayersLoss,
    params: Sequence[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    budget: SearchBudget,
    compile_step: bool = False,
) -> Choice:
    """Formulations for the clients of ``x`` [C, B, ...] by measurement (module docstring);
    ``compile_step``: then also the step through ``torch.compile`` with them (``compiled``)."""
    t0 = time.perf_counter()
    C = x.shape[0]
    start = defaults(engine, params, x)
    forms = dict(start)
    why = {p: "the default; the only formulation for this layer" for p in forms}
    inputs = layer_inputs(engine, params, x)
    groups = groups_of(engine, {p: t for p, (t, _) in inputs.items()})
    timer = Timer(engine, params, x, y, w, budget)
    timer.inputs = inputs
    times: Dict[str, Dict[str, float]] = {}
    changes: List[Change] = []
    for paths in groups.values():
        for p in paths:
            why[p] = "the default; not measured: the search's time budget was spent"
    for sig, paths in groups.items():
        if budget.left() <= 0:
            break
        layer, current = engine.layers_net.layers[paths[0]], forms[paths[0]]
        alone = timer.compare({f: ("alone", paths[0], f) for f in candidates(layer, inputs[paths[0]][0])})
        times[sig] = alone
        if not alone:
            continue
        best, base = min(alone, key=lambda f: alone[f]), alone.get(current)
        if base is None or (best != current and alone[best] < base * (1 - budget.margin)):
            chosen, verdict = best, f"measured fastest (the layer alone: {_ms(alone)})"
            changes.append(Change(math.inf if base is None else base - alone[best], paths, best, _ms(alone)))
        elif best == current:
            chosen, verdict = current, f"the default, measured fastest (the layer alone: {_ms(alone)})"
        else:
            chosen = current
            verdict = f"the default, kept: no candidate {budget.margin:.0%} faster (the layer alone: {_ms(alone)})"
        for p in paths:
            forms[p], why[p] = chosen, verdict
    forms, step_s = _whole_step(timer, start, forms, changes, why, budget)
    engine.layers_net.set_formulations(forms)
    choice = Choice(C, forms, why, step_s, "measured", time.perf_counter() - t0, times)
    if compile_step and step_s is not None:
        _try_compiled(engine, params, x, y, w, budget, choice)
        choice.spent_s = time.perf_counter() - t0
    return choice


class Change(NamedTuple):
    """A group's formulation that was faster alone than its default: what the whole step checks."""

    gain: float  # seconds the layer alone saved
    paths: List[str]
    form: str
    alone: str  # the candidates' times alone, for the reason


def _whole_step(
    timer: Timer,
    start: Dict[str, str],
    forms: Dict[str, str],
    changes: List[Change],
    why: Dict[str, str],
    budget: SearchBudget,
) -> Tuple[Dict[str, str], Optional[float]]:
    """The layers alone leave out what neighbours share (a grouped run's layout copies), so the whole
    step decides: the assembled choice ``forms`` is kept if its step is not slower than the defaults'
    (``start``); if it is slower, the changes are tried one at a time in the whole step, the largest
    gain alone first, each kept if the step with it is not slower than without. Returns the kept
    formulations and their step's median time."""
    if forms == start:
        return forms, timer.steps({"default": start}).get("default")
    step = timer.steps({"chosen": forms, "default": start})
    if step.get("chosen") is not None and step["chosen"] <= step.get("default", math.inf):
        return forms, step["chosen"]
    together = "out of memory" if step.get("chosen") is None else f"{step['chosen'] * 1e3:.3g} ms"
    kept, kept_s = dict(start), step.get("default")
    for change in sorted(changes, key=lambda c: -c.gain):
        head = f"{change.form} was fastest alone ({change.alone})"
        if budget.left() <= 0:
            reason = f"the default, kept: {head}; all such changes together were slower in the whole step "
            reason += f"({together}), and the budget ended before this one was tried alone"
        else:
            trial = {**kept, **{p: change.form for p in change.paths}}
            t = timer.steps({"with": trial, "without": kept})
            if t.get("with") is not None and t["with"] <= t.get("without", math.inf):
                kept, kept_s = trial, t["with"]
                step_ms = _ms({"with it": t["with"], "without": t["without"]})
                reason = f"measured fastest alone ({change.alone}) and in the whole step ({step_ms})"
            else:
                shown = "out of memory" if t.get("with") is None else _ms(t)
                reason = f"the default, kept: {head} but not in the whole step ({shown})"
        for p in change.paths:
            why[p] = reason
    return kept, kept_s


def _try_compiled(engine: LayersLoss, params, x, y, w, budget: SearchBudget, choice: Choice) -> None:
    """The chosen step through ``torch.compile`` (its first run compiles), kept if ``margin`` faster."""
    assert choice.step_s is not None
    compiled = CompiledLayersLoss(
        engine.model, formulations=choice.formulations, order=engine.order, precision=engine.precision
    )
    timer = Timer(compiled, params, x, y, w, budget)
    try:
        t = timer.steps({"compiled": choice.formulations}).get("compiled")
    except NotCompilable as exc:
        choice.compile_note = f"not compiled: {exc}"
        return
    eager = choice.step_s
    if t is not None and t < eager * (1 - budget.margin):
        choice.compiled, choice.step_s = True, t
        choice.compile_note = f"compiled with torch.compile: step {t * 1e3:.3g} ms against {eager * 1e3:.3g} ms eager"
    else:
        shown = "out of memory" if t is None else f"{t * 1e3:.3g} ms"
        choice.compile_note = f"not compiled: torch.compile's step {shown}, not {budget.margin:.0%} faster"


def time_step(engine: LayersLoss, params, x, y, w, forms: Dict[str, str], budget: SearchBudget) -> Optional[float]:
    """The median step time with ``forms`` (None: out of memory)."""
    return Timer(engine, params, x, y, w, budget).steps({"step": forms}).get("step")


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

    def key(self, params: Sequence[torch.Tensor], x: torch.Tensor) -> Tuple[str, Dict[str, Any]]:
        """The cache key of a step at ``x``'s shape: device, torch, every layer's signature and candidates."""
        inputs = layer_inputs(self.engine, params, x)
        layers = {
            p: {
                "signature": layer_signature(self.engine, p, t),
                "candidates": list(candidates(self.engine.layers_net.layers[p], t)),
            }
            for p, (t, _) in inputs.items()
        }
        order = self.engine.context(x.shape[0], x.shape[1], x.device).order
        return step_key(x.device, layers, x.shape[0], x.shape[1], order, self.precision)

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
        """The choice for ``clients`` at once: made before, the defaults (``default``), or measured."""
        choice = self.known(clients)
        if choice is None:
            params, x, y, w = self.inputs(clients)
            if self.mode == "default":
                forms = defaults(self.engine, params, x)
                choice = Choice(clients, forms, {p: "the default (formulations='default')" for p in forms})
            else:
                compile_step = self.compile_step
                if compile_step is None:
                    compile_step = self.mode == "measure" and x.device.type == "cuda"
                choice = search(self.engine, params, x, y, w, budget, compile_step)
                self.spent_s += choice.spent_s
                key, described = self.key(params, x)
                _PROCESS[key] = choice.to_json()
                if self.cache is not None:
                    self.cache.put(key, described, choice.to_json())
        self.choices[clients] = choice
        self.engine.layers_net.set_formulations(choice.formulations)
        return choice

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
        training time, of which ``auto`` spends at most ``AUTO_SHARE`` searching; ``budget_s``: a
        limit of the user's instead (seconds)."""
        sizes = [fixed] if fixed is not None else chunk_sizes(sampled, fit)
        budget = SearchBudget(budget_s)
        if self.mode == "default":
            return sizes[0], self.at(sizes[0], budget)
        if self.mode == "auto" and budget_s is None and any(self.known(n) is None for n in sizes):
            params, x, y, w = self.inputs(sizes[0])
            t = time_step(self.engine, params, x, y, w, defaults(self.engine, params, x), budget)
            if t is not None:
                budget.seconds = AUTO_SHARE * t * math.ceil(sampled / sizes[0]) * steps_per_run
        best: Optional[Tuple[float, int]] = None
        for n in sizes:
            if best is not None and budget.left() <= 0 and self.known(n) is None:
                break
            choice = self.at(n, budget)
            if choice.step_s is None and len(sizes) > 1:  # not timed (nothing to choose, or not reached)
                params, x, y, w = self.inputs(n)
                choice.step_s = time_step(self.engine, params, x, y, w, choice.formulations, budget)
            if choice.step_s is not None:
                round_s = choice.step_s * math.ceil(sampled / n)
                if best is None or round_s < best[0]:
                    best = (round_s, n)
        self.spent_s = max(self.spent_s, budget.spent)
        n = sizes[0] if best is None else best[1]
        return n, self.at(n, budget)
