"""Minimum bytes one optimizer step must move through memory (SPEC §7), the roofline numerator.

``bytes_per_step`` is the single definition every figure of the benchmark uses. It counts each
tensor stream a step must read or write, once per pass that needs it, at that stream's element
size, and assumes nothing is reused from a cache between passes or steps (true for the large
list on any device). Streams, with ``E`` = parameter element size and ``S`` = the size of the
float32 state (8 for float64 parameters):

SGD family (FedDecaySGD, NeuronLRSGD, torch.optim.SGD), one pass::

    read x, g; write x                        3E    (12 B for float32)
    momentum: read + write buf               +2E    (20 B)
    SCAFFOLD correction: read c              +E
    FedProx: read x0                         +E
    NeuronLRSGD scales: read r               +S per *row* (x[m, ...] shares r[m]), not per element

FedNAR, two passes (global norm of d, then the update)::

    norm pass: read g (+ x when weight_decay or prox needs it)      E (+E)
    update:    read g, x; write x                                   3E
    correction / x0: read in both passes                            +2E each    (20 / 28 / 36 B)

PAdaMFed, two passes (D and acc are kept in float32, whatever the parameter dtype)::

    norm pass: read g, D, acc; write acc      E + 3S
    update:    read g, D, x; write x          3E + S                (32 B for float32)
    variance reduction: read H in both passes                       +2E

A copy ``dst.copy_(src)`` counts read + write bytes the same way, so "% of copy bandwidth" is
the fraction of the machine's achievable streaming rate a step reaches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Traffic:
    """The options of a step that change its memory traffic."""

    family: str                     # "sgd", "fednar" or "padamfed"
    momentum: bool = False          # sgd: momentum buffer read + written
    weight_decay: bool = False      # fednar: the norm pass must read x as well
    correction: bool = False        # SCAFFOLD correction tensor read
    prox: bool = False              # FedProx anchor x0 read
    neuron_scale: bool = False      # NeuronLRSGD per-row scale read
    variance_reduction: bool = False  # PAdaMFed VR: anchor gradient H read


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_element(t: Traffic, dtype: torch.dtype) -> int:
    """Bytes per parameter element (row terms excluded) for parameters of ``dtype``."""
    E = _elem(dtype)
    S = 8 if dtype == torch.float64 else 4
    extra = E * (int(t.correction) + int(t.prox))
    if t.family == "sgd":
        return 3 * E + 2 * E * int(t.momentum) + extra
    if t.family == "fednar":
        norm = E + E * int(t.weight_decay or t.prox)
        return norm + 3 * E + 2 * extra
    if t.family == "padamfed":
        return (E + 3 * S) + (3 * E + S) + 2 * E * int(t.variance_reduction)
    raise ValueError(f"unknown traffic family {t.family!r}")


def bytes_per_step(t: Traffic, shapes: Sequence[Shape], dtype: torch.dtype) -> int:
    """Minimum bytes one step over parameters of ``shapes`` and ``dtype`` moves (module docstring)."""
    numel = 0
    rows = 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        numel += n
        if len(shape) > 0 and n > 0:
            rows += shape[0]
    total = numel * bytes_per_element(t, dtype)
    if t.neuron_scale:
        total += rows * (8 if dtype == torch.float64 else 4)
    return total
