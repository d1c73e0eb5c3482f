"""Minimum bytes one optimizer step must move through memory (docs/benchmarks.md), the roofline numerator.

``bytes_per_step`` is the single definition every figure of the benchmark uses. The numbers come
from each op's declaration (``fedopt_kernels/core/ops.py``: for every role, how often a step reads and
writes each element, and whether it is stored in the parameter dtype or as float32 state): a
step reads or writes every stream once per pass that needs it, at that stream's element size,
and nothing is reused from a cache between passes or steps (true for the large list on any
device). Per-row streams (NeuronLRSGD's scales) count once per row. For float32 parameters:

    SGD family (FedDecaySGD, NeuronLRSGD, torch.optim.SGD)   12 B (+8 momentum, +4 x0, +4 correction)
    FedNAR (norm pass, then update)                          20 B (+8 x0, +8 correction)
    PAdaMFed (D and acc are float32 state)                   32 B (+8 variance reduction)
    FedSAM (ascent op, restore copy, SGD op)                 20 + 8 + 12 B (+8 momentum, ...)

A copy ``dst.copy_(src)`` counts read + write bytes the same way, so "% of copy bandwidth" is
the fraction of the machine's achievable streaming rate a step reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from fedopt_kernels.core.ops import OPS

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Traffic:
    """An op and the optional roles its step uses (``catalogue.Config.present()``); ``also``: other
    ops the step runs, with their roles (FedSAM's ascent); ``streams``: element streams it moves
    besides the ops', in the parameters' dtype (FedSAM's restore of x: a read and a write)."""

    op: str
    present: Tuple[str, ...] = ()
    also: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    streams: int = 0


def _sizes(dtype: torch.dtype) -> Tuple[int, int]:
    elem = torch.empty((), dtype=dtype).element_size()
    return elem, 8 if dtype == torch.float64 else 4


def bytes_per_element(t: Traffic, dtype: torch.dtype) -> int:
    """Bytes per parameter element (row terms excluded) for parameters of ``dtype``."""
    elem, state = _sizes(dtype)
    ops = ((t.op, t.present),) + t.also
    return sum(OPS[op].bytes_per_element(present, elem, state) for op, present in ops) + t.streams * elem


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
    _, state = _sizes(dtype)
    for op, present in ((t.op, t.present),) + t.also:
        for role in OPS[op].optional:
            if role.per_row and role.name in present:
                total += rows * state * (role.reads + role.writes)
    return total
