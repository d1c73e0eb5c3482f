"""Every client layer of a model alone, forward + backward on the input it gets in a real step, under
each of its candidate formulations, the candidates of a layer timed interleaved."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Tuple

import torch

from fedopt_kernels.sim.batched.layers_engine import LayersLoss
from fedopt_kernels.sim.batched.precision import autocast_scope, precision_scope

from ..timing import Budget, median, time_interleaved
from .workload import Workload


def _layer_inputs(
    engine: LayersLoss, wl: Workload, stacked: List[torch.Tensor]
) -> Dict[str, Tuple[torch.Tensor, bool]]:
    """Each layer's input in one step under the default formulations, and whether it needed a gradient."""
    inputs: Dict[str, Tuple[torch.Tensor, bool]] = {}

    def keep(path: str, args: tuple) -> None:  # a pre-hook that returns something replaces the input
        inputs.setdefault(path, (args[0].detach(), args[0].requires_grad))

    hooks = [
        layer.register_forward_pre_hook(lambda m, a, path=path: keep(path, a))
        for path, layer in engine.layers_net.layers.items()
    ]
    try:
        engine.grads(stacked, wl.x[0], wl.y[0], wl.w[0])
    finally:
        for h in hooks:
            h.remove()
    return inputs


def layer_rows(
    name: str, wl: Workload, engine: LayersLoss, budget: Budget, log: Callable[[str], None]
) -> List[Dict[str, Any]]:
    """Forward + backward of every client layer of ``engine`` (default formulations) alone under each
    formulation it has, on its real input; a row per layer and formulation."""
    device = wl.device
    stacked = [g.unsqueeze(0).repeat(wl.clients, *([1] * g.dim())).contiguous() for g in wl.glob]
    inputs = _layer_inputs(engine, wl, stacked)
    default = engine.layers_net.formulations()
    ctx = engine.context(wl.clients, wl.x.shape[2], device)
    slots: Dict[int, List[Tuple[str, torch.Tensor]]] = {id(layer): [] for layer in engine.layers_net.layers.values()}
    for (layer, attr), t in zip(engine.layers_net.slots, stacked):
        slots[id(layer)].append((attr, t))
    rows = []
    for path, layer in engine.layers_net.layers.items():
        if path not in inputs:
            continue
        x, needs_grad = inputs[path]
        forms = layer.candidates(x)
        if len(forms) < 2:
            continue
        x = x.requires_grad_() if needs_grad else x
        ps = {a: t.detach().requires_grad_() for a, t in slots[id(layer)]}

        def call(form: str, layer: Any = layer, x: torch.Tensor = x, ps: Dict[str, torch.Tensor] = ps) -> None:
            layer.formulation, layer.params, layer.ctx = form, ps, ctx
            with precision_scope(wl.precision, device):
                with autocast_scope(wl.precision, device):
                    out = layer(x)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(torch.ones_like(out))

        timed = time_interleaved([functools.partial(call, form) for form in forms], device, budget)
        for form, res in zip(forms, timed):
            row = dict(model=name, clients=wl.clients, layer=path, kind=layer.kind, formulation=form)
            if res.error is not None:
                rows.append(dict(row, error=res.error))
                continue
            rows.append(dict(row, default=form == default.get(path), step_s=median(res.times)))
            log(
                f"  {name} C={wl.clients} layer {path:<24} {form:<13} {median(res.times) * 1e3:9.3f} ms"
                + ("  (default)" if form == default.get(path) else "")
            )
        layer.formulation, layer.params = None, {}
    return rows
