"""One search of the client layers' formulations at C clients, by measurement (``choose.py`` runs it).

``layer_inputs`` gives each client layer's input in the step, ``layer_signature`` and ``groups_of``
the groups of layers that share a choice, ``defaults`` the fixed default of each. ``search`` then
times each group's candidates alone and the assembled choice in the whole step (``choose.py``'s
docstring says how), through ``timing.Timer``; a candidate that fails with an error of its own is
dropped for the run (``dropped``) with one warning (``core/fallbacks.py``), the default's error is
raised. ``_try_compiled`` adds the step through ``torch.compile``; ``time_step`` and ``probe_step``
time one assignment's whole step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from ...core import fallbacks
from . import timing
from .compiled import CompiledLayersLoss, NotCompilable
from .layers import ClientLayer
from .layers_engine import LayersLoss
from .timing import Comparison, SearchBudget, Timer, out_of_memory

Dropped = Set[Tuple[str, str]]  # (layer signature, formulation) that failed in this run


@dataclass
class Choice:
    """The formulations chosen for C clients: module path -> formulation (empty: every layer's default,
    as it picks it at its first call: a search skipped), and why each."""

    clients: int
    formulations: Dict[str, str]
    why: Dict[str, str]
    step_s: Optional[float] = None  # median time of one step with these formulations (None: not timed)
    source: str = "default"  # default | measured | process | cache
    spent_s: float = 0.0  # what finding it cost (0 when it came from a cache)
    times_s: Dict[str, Dict[str, float]] = field(default_factory=dict)  # group -> candidate -> median
    compiled: bool = False  # the step runs through torch.compile (CompiledLayersLoss)
    compile_note: str = ""  # whether torch.compile was tried, and what it measured
    spread: float = 0.0  # the largest quartile spread / median of its timed calls (timing.spread)
    note: str = ""  # what the search did as a whole: skipped and why, not cached and why

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


# ------------------------------------------------------------------ the search
def defaults(engine: LayersLoss, params: Sequence[torch.Tensor], x: torch.Tensor) -> Dict[str, str]:
    """The fixed default formulation of every client layer at this input (one forward pass)."""
    engine.layers_net.set_formulations(None)
    with torch.no_grad():
        engine.logits(params, x)
    return dict(engine.layers_net.formulations())


def _ms(times: Dict[str, float]) -> str:
    return ", ".join(f"{f} {times[f] * 1e3:.3g} ms" for f in sorted(times, key=lambda f: times[f]))


def _failures(cmp: Comparison, choice_of: Union[str, Callable[[str], str]], instead: str) -> str:
    """Warn (once each, ``core/fallbacks.py``) of the options that failed with an error of their own;
    out of memory is a measurement's outcome, said in ``why`` only. Returns the failures for ``why``."""
    shown = []
    for name, exc in cmp.failed.items():
        if out_of_memory(exc):
            shown.append(f"{name} out of memory")
        else:
            choice = choice_of if isinstance(choice_of, str) else choice_of(name)
            shown.append(f"{name} failed: {fallbacks.fall_back(choice, exc, instead, 6).error}")
    return "; ".join(shown)


class Change(NamedTuple):
    """A group's formulation that was faster alone than its default: what the whole step checks."""

    gain: float  # seconds the layer alone saved
    signature: str
    paths: List[str]
    form: str
    alone: str  # the candidates' times alone, for the reason


class _Search:
    """One search's state: the engine's timer, what it found, and the choices dropped in the run."""

    def __init__(self, engine: LayersLoss, params, x, y, w, budget: SearchBudget, dropped: Dropped):
        self.engine, self.budget, self.dropped = engine, budget, dropped
        self.C = x.shape[0]
        self.timer = Timer(engine, params, x, y, w, budget)
        self.spread = 0.0

    def compare(self, options: Dict[str, tuple], proven: Optional[str]) -> Comparison:
        cmp = self.timer.compare(options, proven)
        self.spread = max(self.spread, cmp.spread)
        return cmp

    def steps(self, assignments: Dict[str, Dict[str, str]], proven: str) -> Comparison:
        cmp = self.timer.steps(assignments, proven)
        self.spread = max(self.spread, cmp.spread)
        return cmp

    def group(self, sig: str, paths: List[str], current: str, forms: Dict[str, str], why: Dict[str, str]):
        """The group's candidates alone; the faster one's ``Change`` (or None) and their times."""
        layer = self.engine.layers_net.layers[paths[0]]
        x = self.timer.inputs[paths[0]][0]
        cands = [f for f in candidates(layer, x) if f == current or (sig, f) not in self.dropped]
        if len(cands) < 2:
            for p in paths:
                why[p] = "the default; its other formulations failed earlier in this run"
            return None, {}
        where = f"{paths[0]} ({sig}) at {self.C} clients"
        cmp = self.compare({f: ("alone", paths[0], f) for f in cands}, proven=current)
        self.dropped.update((sig, f) for f, e in cmp.failed.items() if not out_of_memory(e))
        failed = _failures(cmp, lambda f: f"formulation {f!r} of {where}", f"{paths[0]}'s other formulations")
        failed = f"; {failed}" if failed else ""
        alone = cmp.times
        if cmp.short or not alone:
            for p in paths:
                why[p] = f"the default; not measured: the search's time budget was spent{failed}"
            return None, alone
        best, base = min(alone, key=lambda f: alone[f]), alone.get(current)
        change = None
        if base is None or (best != current and alone[best] < base * (1 - self.budget.margin)):
            chosen, verdict = best, f"measured fastest (the layer alone: {_ms(alone)}{failed})"
            change = Change(math.inf if base is None else base - alone[best], sig, paths, best, _ms(alone))
        elif best == current:
            chosen, verdict = current, f"the default, measured fastest (the layer alone: {_ms(alone)}{failed})"
        else:
            chosen = current
            margin = self.budget.margin
            verdict = f"the default, kept: no candidate {margin:.0%} faster (the layer alone: {_ms(alone)}{failed})"
        for p in paths:
            forms[p], why[p] = chosen, verdict
        return change, alone

    def whole_step(
        self, start: Dict[str, str], forms: Dict[str, str], changes: List[Change], why: Dict[str, str]
    ) -> Tuple[Dict[str, str], Optional[float]]:
        """The layers alone leave out what neighbours share (a grouped run's layout copies), so the whole
        step decides: the assembled choice ``forms`` is kept if its step is not slower than the defaults'
        (``start``); if it is slower, the changes are tried one at a time in the whole step, the largest
        gain alone first, each kept if the step with it is not slower than without. Returns the kept
        formulations and their step's median time (None: not timed)."""
        if forms == start:
            return forms, self.steps({"default": start}, "default").times.get("default")
        step = self.steps({"chosen": forms, "default": start}, "default")
        _failures(
            step, lambda _: f"the formulations chosen alone, together in one step at {self.C} clients", "each alone"
        )
        if step.short:
            for c in changes:
                for p in c.paths:
                    why[p] = f"the default, kept: {c.form} was fastest alone ({c.alone}); the budget ended first"
            return dict(start), None
        chosen_s, default_s = step.times.get("chosen"), step.times.get("default", math.inf)
        if chosen_s is not None and chosen_s <= default_s:
            return forms, chosen_s
        together = "failed" if chosen_s is None else f"{chosen_s * 1e3:.3g} ms"
        kept, kept_s = dict(start), step.times.get("default")
        for change in sorted(changes, key=lambda c: -c.gain):
            head = f"{change.form} was fastest alone ({change.alone})"
            trial = {**kept, **{p: change.form for p in change.paths}}
            t = self.steps({"with": trial, "without": kept}, "without")
            if "with" in t.failed and not out_of_memory(t.failed["with"]):
                self.dropped.add((change.signature, change.form))
            where = f"formulation {change.form!r} of {change.paths[0]} in the whole step"
            failed = _failures(t, where, "the default")
            if t.short:
                reason = f"the default, kept: {head}; all such changes together were slower in the whole step "
                reason += f"({together}), and the budget ended before this one was tried alone"
            elif t.times.get("with") is not None and t.times["with"] <= t.times.get("without", math.inf):
                kept, kept_s = trial, t.times["with"]
                step_ms = _ms({"with it": t.times["with"], "without": t.times["without"]})
                reason = f"measured fastest alone ({change.alone}) and in the whole step ({step_ms})"
            else:
                reason = f"the default, kept: {head} but not in the whole step ({failed or _ms(t.times)})"
            for p in change.paths:
                why[p] = reason
        return kept, kept_s


def search(
    engine: LayersLoss,
    params: Sequence[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    budget: SearchBudget,
    compile_step: bool = False,
    dropped: Optional[Dropped] = None,
) -> Choice:
    """Formulations for the clients of ``x`` [C, B, ...] by measurement (module docstring);
    ``compile_step``: then also the step through ``torch.compile`` with them (``compiled``);
    ``dropped``: the (signature, formulation) pairs that failed earlier in the run (not tried, and
    those failing now are added)."""
    t0 = timing.CLOCK()
    C = x.shape[0]
    start = defaults(engine, params, x)
    forms = dict(start)
    why = {p: "the default; the only formulation for this layer" for p in forms}
    run = _Search(engine, params, x, y, w, budget, set() if dropped is None else dropped)
    run.timer.inputs = layer_inputs(engine, params, x)
    groups = groups_of(engine, {p: t for p, (t, _) in run.timer.inputs.items()})
    times: Dict[str, Dict[str, float]] = {}
    changes: List[Change] = []
    for sig, paths in groups.items():
        change, alone = run.group(sig, paths, forms[paths[0]], forms, why)
        times[sig] = alone
        if change is not None:
            changes.append(change)
    forms, step_s = run.whole_step(start, forms, changes, why)
    engine.layers_net.set_formulations(forms)
    choice = Choice(C, forms, why, step_s, "measured", timing.CLOCK() - t0, times, spread=run.spread)
    if compile_step and step_s is not None:
        _try_compiled(engine, params, x, y, w, budget, choice)
        choice.spent_s = timing.CLOCK() - t0
    return choice


def _try_compiled(engine: LayersLoss, params, x, y, w, budget: SearchBudget, choice: Choice) -> None:
    """The chosen step through ``torch.compile`` (its first run compiles), kept if ``margin`` faster;
    a compiler that fails (or a compiled step that does) leaves the eager step, saying why."""
    eager = choice.step_s
    assert eager is not None
    try:
        compiled = CompiledLayersLoss(
            engine.model, formulations=choice.formulations, order=engine.order, precision=engine.precision
        )
        timer = Timer(compiled, params, x, y, w, budget)
        cmp = timer.steps({"compiled": choice.formulations})
    except NotCompilable as exc:
        choice.compile_note = f"not compiled: {exc}"
        return
    except Exception as exc:  # noqa: BLE001 - the compiler's failure, not the inputs' (the eager step ran)
        cmp = Comparison(failed={"compiled": exc})
    error = cmp.failed.get("compiled")
    if isinstance(error, NotCompilable):
        choice.compile_note = f"not compiled: {error}"
        return
    choice.spread = max(choice.spread, cmp.spread)
    t = cmp.times.get("compiled")
    if t is not None and t < eager * (1 - budget.margin):
        choice.compiled, choice.step_s = True, t
        choice.compile_note = f"compiled with torch.compile: step {t * 1e3:.3g} ms against {eager * 1e3:.3g} ms eager"
    elif error is not None:
        failed = _failures(cmp, f"the compiled step (torch.compile) at {choice.clients} clients", "eager")
        choice.compile_note = f"not compiled: torch.compile's step {failed}"
    elif t is None:
        choice.compile_note = "not compiled: the budget ended before torch.compile's step was timed"
    else:
        choice.compile_note = f"not compiled: torch.compile's step {t * 1e3:.3g} ms, not {budget.margin:.0%} faster"


def time_step(engine: LayersLoss, params, x, y, w, forms: Dict[str, str], budget: SearchBudget) -> Optional[float]:
    """The median step time with ``forms`` (None: out of memory, or the budget ended first); an error
    of the step is raised."""
    return Timer(engine, params, x, y, w, budget).steps({"step": forms}, "step").times.get("step")


def probe_step(engine: LayersLoss, params, x, y, w, forms: Dict[str, str], budget: SearchBudget) -> Optional[float]:
    """``time_step`` in exactly ``MIN_ROUNDS`` rounds, whatever the budget (it is sized from this)."""
    timer = Timer(engine, params, x, y, w, budget)
    timer.assignments["step"] = forms
    return timer.compare({"step": ("step", "step")}, "step", probe=True).times.get("step")
