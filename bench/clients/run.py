"""A client-batched benchmark run: the device's FLOP/s at the start and the end, and between them every
model at every C, a size at a time (every model's smallest C first), so that a run cut at its
deadline has a row for every model."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List

import torch

from fedopt_kernels.sim.models.build import build_model

from ..peak import device_peak
from ..stopping import sigterm_interrupts
from ..timing import error_text
from .measure import measure
from .settings import FUSED, SETTINGS
from .workload import client_step_flops


def _describe(args: argparse.Namespace, name: str) -> Dict[str, Any]:
    """What the table states about a model in its setting."""
    s = SETTINGS[name]
    model = build_model(s.model, s.shape, s.classes, **s.kwargs)
    return dict(
        paper=s.paper,
        shape=list(s.shape),
        classes=s.classes,
        batch=args.batch_of[name],
        steps=args.steps_of[name],
        parameters=sum(p.numel() for p in model.parameters()),
    )


def _sequential_at(args: argparse.Namespace, sizes: List[int], device: torch.device) -> List[int]:
    """The C at which the sequential mode runs (``--seq-clients``, ``--seq-max-clients``)."""
    if args.seq_clients:
        return [args.seq_clients]
    if device.type == "cpu":  # other processes' load moves: compare within each C's interleaving
        return [C for C in sizes if C <= args.seq_max_clients] or [min(sizes)]
    return [min(sizes)]  # on a GPU its rate does not depend on C


def run(args: argparse.Namespace, device: torch.device, result: Dict[str, Any], log: Callable[[str], None]) -> None:
    """Measure into ``result`` (rows, models, peak); a SIGINT or SIGTERM stops it with what it has,
    ``meta["interrupted"]`` set."""
    peak_s = 0.05 if args.smoke else 0.5
    result["peak"].append(device_peak(device, min_time_s=peak_s, precision=args.precision))
    try:
        with sigterm_interrupts():
            seq_of: Dict[str, List[int]] = {}
            for name in args.models:
                result["models"][name] = _describe(args, name)
                sizes = args.clients_of[name]
                seq_of[name] = _sequential_at(args, sizes, device)
                args.clients_of[name] = sorted(set(sizes) | set(seq_of[name]))
            for i in range(max(len(v) for v in args.clients_of.values())):
                for name in args.models:
                    if i < len(args.clients_of[name]):
                        result["rows"] += _one(name, args.clients_of[name][i], args, device, seq_of[name], result, log)
            result["peak"].append(device_peak(device, min_time_s=peak_s, precision=args.precision))
    except KeyboardInterrupt:  # a deadline's SIGINT: keep and write what was measured
        result["meta"]["interrupted"] = True
        log("bench clients: interrupted; writing the cases measured so far")


def _one(
    name: str,
    C: int,
    args: argparse.Namespace,
    device: torch.device,
    seq_at: List[int],
    result: Dict[str, Any],
    log: Callable[[str], None],
) -> List[Dict[str, Any]]:
    """Model ``name`` at C clients, or one error row when it cannot run (out of memory, say: the next
    case may still fit)."""
    try:
        model = result["models"][name]
        if "flops_per_client_step" not in model:
            model["flops_per_client_step"] = client_step_flops(SETTINGS[name], args.batch_of[name], device)
        return measure(name, C, args, device, seq_at, log)
    except (RuntimeError, ValueError) as exc:
        row = dict(model=name, clients=C, mode=FUSED, error=error_text(exc))
        log(f"  {name} C={C}: {row['error']}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return [row]
