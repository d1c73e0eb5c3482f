"""A chunk of clients' replies clipped and summed in one call: the client-batched engine's DP step."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..core.clip_sum import clip_sum


def clip_sum_batched(
    tensors: Sequence[torch.Tensor],
    max_norm: float,
    active: Optional[torch.Tensor] = None,
    out: Optional[Sequence[torch.Tensor]] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """``(norms, factors, below, sums)`` of a chunk of C clients' replies, each tensor ``[C, *shape]``:

    * ``norms[c] = ||reply_c||``, the global L2 norm over every tensor's row c (squares in float64);
    * ``factors[c] = min(1, max_norm / norms[c])`` for an active client, 0 for an inactive one;
    * ``below[c] = active[c] and norms[c] <= max_norm`` (adaptive clipping's bit);
    * ``sums[j] (+)= sum_c factors[c] * tensors[j][c]`` in float64, clients added in order 0..C-1
      (a fold's order); an inactive client's row is never read into the sum (it may hold anything).

    ``out``: float64 sums (one ``[*shape]`` per tensor) to add into; new zeros when None.
    ``active``: bool ``[C]`` (None: all). Views and non-contiguous tensors are read as they are.
    DP-FedAvg's clip (McMahan, Ramage, Talwar, Zhang; ICLR 2018) for the whole chunk as one
    multi-tensor op (``fedopt_kernels.core.clip_sum``: reference, cpu, cuda and triton kernels;
    ``backend`` picks one, ``"auto"`` the tensors' best), no host read-back.
    """
    norms, factors, below, sums = clip_sum(tensors, max_norm, active, out, backend)
    return norms, factors, below, sums
