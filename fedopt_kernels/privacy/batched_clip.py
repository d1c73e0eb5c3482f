"""A chunk of clients' replies clipped and summed in one call: the client-batched engine's DP step."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..fl.fold import sum_dtype


@torch.no_grad()
def clip_sum_batched(
    tensors: Sequence[torch.Tensor],
    max_norm: float,
    active: Optional[torch.Tensor] = None,
    out: Optional[Sequence[torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """``(norms, factors, below, sums)`` of a chunk of C clients' replies, each tensor ``[C, *shape]``:

    * ``norms[c] = ||reply_c||``, the global L2 norm over every tensor's row c (squares in float64);
    * ``factors[c] = min(1, max_norm / norms[c])`` for an active client, 0 for an inactive one;
    * ``below[c] = active[c] and norms[c] <= max_norm`` (adaptive clipping's bit);
    * ``sums[j] (+)= sum_c factors[c] * tensors[j][c]`` in float64, clients added in order 0..C-1
      (a fold's order); an inactive client's row is never read into the sum (it may hold anything).

    ``out``: float64 sums (one ``[*shape]`` per tensor) to add into; new zeros when None.
    ``active``: bool ``[C]`` (None: all). Views and non-contiguous tensors are read as they are.
    The reference of the fused op (DP-FedAvg's clip, McMahan et al., ICLR 2018): norms and factors
    for the whole chunk at once, no host read-back.
    """
    if not max_norm > 0:
        raise ValueError(f"dp_clip must be > 0, got {max_norm!r}")
    if len(tensors) == 0:
        raise ValueError("tensors is empty: a chunk's reply has at least one tensor")
    C, device = tensors[0].shape[0], tensors[0].device
    if any(t.dim() < 1 or t.shape[0] != C for t in tensors):
        raise ValueError(f"every tensor must be [C, *shape] with one C; got {[tuple(t.shape) for t in tensors]}")
    if active is not None and (active.dtype != torch.bool or tuple(active.shape) != (C,)):
        raise ValueError(f"active must be a bool tensor of shape ({C},), got {active.dtype} {tuple(active.shape)}")
    squares = torch.zeros(C, dtype=torch.float64, device=device)
    for t in tensors:
        t64 = t.to(torch.float64)
        squares += (t64 * t64).reshape(C, -1).sum(dim=1)  # per client, then across tensors in order
    norms = squares.sqrt()
    factors = torch.clamp(max_norm / norms, max=1.0)
    below = norms <= max_norm
    if active is not None:
        factors = torch.where(active, factors, torch.zeros_like(factors))
        below = below & active
    sums = [torch.zeros(t.shape[1:], dtype=sum_dtype(t), device=device) for t in tensors] if out is None else list(out)
    for s, t in zip(sums, tensors, strict=True):
        for c in range(C):  # client order, as a fold adds them
            term = t[c].to(s.dtype) * factors[c]
            s.add_(term if active is None else torch.where(active[c], term, torch.zeros_like(term)))
    return norms, factors, below, sums
