"""One model at one C: the formulations chosen, every mode's round timed interleaved (``timing.time_rounds``)
with its peak memory, and the parts of a step (the gradients alone, the update alone) timed interleaved
(``timing.time_interleaved``)."""

from __future__ import annotations

import argparse
import gc
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from fedopt_kernels import FedNAR
from fedopt_kernels.batched import BatchedFedNAR
from fedopt_kernels.sim.batched.choose import Chooser, SearchBudget, defaults
from fedopt_kernels.sim.batched.compiled import CompiledLayersLoss
from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.batched.loss import VmapLoss
from fedopt_kernels.sim.batched.precision import check_supported
from fedopt_kernels.sim.batched.size import activation_bytes, free_bytes

from ..timing import error_text, median, sync, time_interleaved, time_rounds
from .layers import layer_rows
from .peak_memory import PeakMemory
from .results import fmt_rate
from .settings import CHUNKED, DEFAULTS, FUSED, HP, PLAIN, REPLAY, SEQ, SETTINGS, VMAP
from .workload import (
    Workload,
    chunked_round,
    fused_backend,
    fused_round,
    fused_trainer,
    plain_fednar_,
    plain_round,
    sequential_backend,
    sequential_round,
)

Row = Dict[str, Any]
Build = Callable[[], Callable[[], None]]  # makes a mode's round (what it allocates is measured)


@dataclass
class _Modes:
    """The modes of one model at one C: how to build each one's round (with its backend), the modes
    not run with the reason, the chunked mode's chunk size, and the vmap engine (its gradients are a
    part too)."""

    builders: Dict[str, Tuple[str, Build]] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    chunk: Optional[int] = None
    vmap_loss: Optional[VmapLoss] = None


def _stacked(wl: Workload, clients: int) -> List[torch.Tensor]:
    """The global model repeated for ``clients`` clients, as stacked [C, ...] tensors."""
    return [g.unsqueeze(0).repeat(clients, *([1] * g.dim())).contiguous() for g in wl.glob]


def _choice_inputs(wl: Workload, n: int) -> Tuple[List[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the formulation search times for n of the workload's clients: the global model, step 0."""
    return _stacked(wl, n), wl.x[0, :n], wl.y[0, :n], wl.w[0, :n]


def _clients_that_fit(wl: Workload, device: torch.device) -> int:
    """Clients whose parameters, gradients, state and activations fit in the device's memory budget
    (``sim.batched.size``: half the free memory on CUDA)."""
    params = sum(g.numel() * g.element_size() for g in wl.glob)
    per_client = params * 6 + 2 * activation_bytes(wl.model, wl.x[0, 0], wl.y[0, 0])
    return max(1, free_bytes(device) // per_client)


@dataclass
class _Setup:
    """One model at one C, as every step of ``measure`` reads it."""

    wl: Workload
    args: argparse.Namespace
    name: str
    base: Row  # what every row of it starts with
    chooser: Chooser
    forms: Dict[str, str]  # the formulations chosen for all C clients at once
    engine: LayersLoss  # with them
    default_engine: LayersLoss  # with the defaults


def _modes(setup: _Setup, seq_at: List[int], rows: List[Row]) -> _Modes:
    """Which modes run at this C and how each is built; the chunk search's row goes to ``rows``."""
    wl, args, engine, default_engine = setup.wl, setup.args, setup.engine, setup.default_engine
    C, device = wl.clients, wl.device
    backend = fused_backend(device)
    replay = "cuda" if device.type == "cuda" and backend != "reference" else None
    m = _Modes()
    wanted = args.modes
    if SEQ in wanted:
        if C in seq_at:

            def build_seq() -> Callable[[], None]:
                opt = FedNAR(wl.model.parameters(), **HP)
                return lambda: sequential_round(wl, opt)

            m.builders[SEQ] = (sequential_backend(device), build_seq)
        else:
            m.skipped[SEQ] = f"measured at C={seq_at[0]} (client by client: its rate does not depend on C)"
    # on a GPU the earlier engines (vmap, the update in plain torch) are compared at the smallest C only:
    # the GPU share goes to the engine's own modes at the larger ones
    earlier = device.type == "cpu" or C == min(args.clients_of[setup.name])
    if VMAP in wanted and not earlier:
        m.skipped[VMAP] = "on a GPU at the smallest C only"
    elif VMAP in wanted:
        try:
            vmap_loss = m.vmap_loss = VmapLoss(wl.model, precision=wl.precision)
            m.builders[VMAP] = (backend, lambda: partial(fused_round, wl, fused_trainer(wl, vmap_loss, None)))
        except ValueError as why:
            m.skipped[VMAP] = str(why).split(". ")[0]
    if PLAIN in wanted and not earlier:
        m.skipped[PLAIN] = "on a GPU at the smallest C only"
    elif PLAIN in wanted:
        m.builders[PLAIN] = ("torch", lambda: partial(plain_round, wl, engine, _stacked(wl, C)))
    if DEFAULTS in wanted:
        m.builders[DEFAULTS] = (backend, lambda: partial(fused_round, wl, fused_trainer(wl, default_engine, None)))
    if FUSED in wanted:
        m.builders[FUSED] = (backend, lambda: partial(fused_round, wl, fused_trainer(wl, engine, None)))
    if REPLAY in wanted and device.type == "cuda":
        if replay is None:  # the reference batched ops read step counters on the host: not capturable
            m.skipped[REPLAY] = "no fused client-batched backend to capture (reference)"
        else:
            m.builders[REPLAY] = (backend, lambda: partial(fused_round, wl, fused_trainer(wl, engine, replay)))
    if CHUNKED in wanted and C > 1:
        if args.chunk is not None:
            m.chunk = math.ceil(C / math.ceil(C / args.chunk)) if C > args.chunk else None
            budget = SearchBudget(args.search_budget)
            chunk_forms = setup.forms if m.chunk is None else setup.chooser.at(m.chunk, budget).formulations
        else:
            fit = _clients_that_fit(wl, device)
            chunk, chunk_choice = setup.chooser.plan(C, fit, wl.steps, budget_s=args.search_budget)
            chunk_forms = chunk_choice.formulations
            m.chunk = None if chunk >= C else chunk
            rows.append(dict(setup.base, chunk_choice=chunk_choice.to_json(), search_s=setup.chooser.spent_s, fit=fit))
        if m.chunk is None:
            m.skipped[CHUNKED] = "all C clients at once was fastest (or --chunk >= C)"
        else:
            chunk_engine = LayersLoss(wl.model, formulations=chunk_forms, precision=wl.precision)
            per = m.chunk
            m.builders[CHUNKED] = (
                backend,
                lambda: partial(chunked_round, wl, fused_trainer(wl, chunk_engine, replay, per)),
            )
    return m


def _time_modes(wl: Workload, m: _Modes, rounds: int, base: Row, log: Callable[[str], None]) -> List[Row]:
    """Build every mode and run one untimed round of each (its peak memory measured there), then time
    ``rounds`` rounds of every mode interleaved; a mode's figure is its best round."""
    C, device = wl.clients, wl.device
    runs: Dict[str, Callable[[], None]] = {}
    info: Dict[str, Row] = {}
    for mode, (be, build) in m.builders.items():
        info[mode] = {"backend": be}
        try:
            with PeakMemory(device) as mem:
                fn = build()
                fn()
            sync(device)
            runs[mode] = fn
            if mem.peak is not None:
                info[mode]["peak_bytes"] = mem.peak
                info[mode]["peak_bytes_per_client"] = mem.peak if mode == SEQ else mem.peak / C
        except Exception as exc:  # a failing mode is a result, not a crash
            info[mode]["error"] = error_text(exc)
    timed = time_rounds(runs, device, rounds)
    rows = []
    for mode in m.builders:
        row: Row = dict(base, mode=mode, **info[mode])
        if mode == CHUNKED:
            row["chunk"] = m.chunk
        res = timed.get(mode)
        if res is not None and res.error is not None:
            row["error"] = res.error
        elif res is not None and res.times and "error" not in row:
            best = min(res.times)
            row.update(round_s=best, round_times_s=res.times, client_steps_per_s=C * wl.steps / best)
            row["other_load_cores"] = res.worst_load()
        rows.append(row)
        log(
            f"  {base['model']} C={C:>5} {mode:<22} {row['backend']:<10} "
            + (
                f"{fmt_rate(row['client_steps_per_s']):>12} client-steps/s"
                if "client_steps_per_s" in row
                else f"ERROR {row.get('error')}"
            )
        )
    rows += [dict(base, mode=mode, skipped=reason) for mode, reason in m.skipped.items()]
    return rows


def _time_parts(setup: _Setup, m: _Modes, log: Callable[[str], None]) -> List[Row]:
    """The parts of one step, timed interleaved: the gradients alone (each engine), and the update
    alone on fixed gradients (plain torch, ``BatchedFedNAR``)."""
    wl, engine, default_engine, base = setup.wl, setup.engine, setup.default_engine, setup.base
    C, device = wl.clients, wl.device
    stacked = _stacked(wl, C)
    grads = [torch.randn_like(t) * 0.01 for t in stacked]
    x, y, w = wl.x[0], wl.y[0], wl.w[0]
    parts: List[Tuple[str, str, Callable[[], Any]]] = [
        ("grad layers", "torch", lambda: engine.grads(stacked, x, y, w)),
        ("grad layers default", "torch", lambda: default_engine.grads(stacked, x, y, w)),
    ]
    vmap_loss = m.vmap_loss
    if VMAP in m.builders and vmap_loss is not None:
        parts.append(("grad vmap", "torch", lambda: vmap_loss.grads(stacked, x, y, w)))
    parts.append(("update plain torch", "torch", partial(_no_grad, lambda: plain_fednar_(stacked, grads, **HP))))
    params = [torch.nn.Parameter(t.clone()) for t in stacked]
    opt = BatchedFedNAR(params, **HP)
    for p, g in zip(params, grads):
        p.grad = g
    opt.start_round()
    parts.append(("update fused", fused_backend(device), partial(_no_grad, opt.step)))
    rows = []
    for (part, be, _), res in zip(parts, time_interleaved([fn for _, _, fn in parts], device, setup.args.part_budget)):
        row = dict(base, part=part, backend=be, other_load_cores=res.other_load)
        if res.error is not None:
            row["error"] = res.error
            log(f"  {base['model']} C={C:>5} part {part:<18} {be:<10} ERROR {res.error}")
        else:
            row.update(step_s=median(res.times), reps=len(res.times))
            log(f"  {base['model']} C={C:>5} part {part:<18} {be:<10} {row['step_s'] * 1e3:10.3f} ms/step")
        rows.append(row)
    return rows


def _no_grad(fn: Callable[[], Any]) -> None:
    with torch.no_grad():
        fn()


def measure(
    name: str, C: int, args: argparse.Namespace, device: torch.device, seq_at: List[int], log: Callable[[str], None]
) -> List[Row]:
    """Every mode (interleaved) and part of model ``name`` at C clients; with ``--layers``, at the
    model's largest C, every client layer alone under each of its formulations."""
    steps, batch = args.steps_of[name], args.batch_of[name]
    wl = Workload(SETTINGS[name], C, steps, batch, device, precision=args.precision)
    check_supported(wl.model, wl.precision, device)  # bf16 on a CPU without a kernel for a layer: one clear error
    base: Row = dict(model=name, clients=C, steps=steps, batch=batch)
    chooser = Chooser(
        LayersLoss(wl.model, precision=wl.precision),
        partial(_choice_inputs, wl),
        args.formulations,
        precision=wl.precision,
    )
    _, choice = chooser.plan(C, C, steps, fixed=C, budget_s=args.search_budget)
    fixed = defaults(LayersLoss(wl.model, precision=wl.precision), *_choice_inputs(wl, C)[:2])
    rows: List[Row] = [
        dict(base, choice=choice.to_json(), default_formulations=fixed, search_s=chooser.spent_s, source=choice.source)
    ]
    log(f"  {name} C={C:>5} formulations {choice.formulations} ({chooser.spent_s:.1f} s to choose)")
    forms = choice.formulations
    engine_cls = CompiledLayersLoss if choice.compiled else LayersLoss  # the step as the simulator runs it
    engine = engine_cls(wl.model, formulations=forms, precision=wl.precision)
    setup = _Setup(wl, args, name, base, chooser, forms, engine, LayersLoss(wl.model, precision=wl.precision))
    m = _modes(setup, seq_at, rows)
    rows += _time_modes(wl, m, args.rounds, base, log)
    gc.collect()
    rows += _time_parts(setup, m, log)
    if args.layers and C == max(args.clients_of[name]):
        rows += layer_rows(name, wl, setup.default_engine, args.layer_budget, log)
    return rows
