"""The clipped sum's reference: the op of ``clip_sum.py`` stated in PyTorch, line for line.

Every backend computes what these lines compute: squares in float64, one norm per client over all
its tensors, the factor ``min(1, C / norm)`` (0 for an inactive client), then the clients' scaled
rows added to the float64 sums one client after another, each term rounded once (``fl(f * x)``)
and then added (``fl(s + term)``), with no fused multiply-add.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch


@torch.no_grad()
def clip_sum_reference(
    tensors: Sequence[torch.Tensor], max_norm: float, active: Optional[torch.Tensor], out: List[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(norms, factors, below)``; ``out`` (float64, one ``[*shape]`` per tensor) gets the clipped sum
    added. Arguments already checked (``clip_sum.check``)."""
    C, device = tensors[0].shape[0], tensors[0].device
    squares = torch.zeros(C, dtype=torch.float64, device=device)
    for t in tensors:
        t64 = t.to(torch.float64).reshape(C, math.prod(t.shape[1:]))
        squares += (t64 * t64).sum(dim=1)  # per client, then across tensors in order
    norms = squares.sqrt()
    factors = torch.clamp(max_norm / norms, max=1.0)  # norm 0: C / 0 = inf -> 1; NaN stays NaN
    below = norms <= max_norm
    if active is not None:
        factors = torch.where(active, factors, torch.zeros_like(factors))
        below = below & active
    for s, t in zip(out, tensors, strict=True):
        for c in range(C):  # client order, as a fold adds them
            term = t[c].to(s.dtype) * factors[c]
            # an inactive row is never added: its values (NaN, inf) do not reach the sum
            s.add_(term if active is None else torch.where(active[c], term, torch.zeros_like(term)))
    return norms, factors, below
