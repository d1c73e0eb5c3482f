"""One client's reply clipped to a global L2 norm: DP-FedAvg's bound on what one client adds to a round."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..fl.fold import sum_dtype
from ..functional import global_norm


@torch.no_grad()
def clip(tensors: Sequence[torch.Tensor], max_norm: float) -> Tuple[List[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(clipped, factor, below)``: ``clipped = factor * tensors`` with ``factor = min(1, C / ||tensors||)``,
    and ``below = 1[||tensors|| <= C]`` (the bit adaptive clipping counts).

    ``tensors`` is the whole reply as ONE vector: the model update and whatever else the algorithm
    sends (SCAFFOLD's ``dc``, PAdaMFed's control change), so the bound holds for everything a client
    contributes ("Learning Differentially Private Recurrent Language Models", McMahan, Ramage,
    Talwar, Zhang; ICLR 2018, Algorithm 1's ``ClipFn``). The norm is the package's global norm
    (``functional.global_norm``: squares summed in float64, no overflow for elements up to 1e30).
    ``factor`` and ``below`` are 0-dim tensors on the reply's device (float64 and bool): nothing is
    read back to the host. ``clipped`` is in the fold's sum dtype (float64; ``fl.fold.sum_dtype``),
    so the product is rounded once, the way the fold's sums are kept. ``C = inf`` clips nothing.
    """
    if not max_norm > 0:
        raise ValueError(f"dp_clip must be > 0, got {max_norm!r}")
    norm = global_norm(list(tensors))
    factor = torch.clamp(max_norm / norm, max=1.0)  # norm 0: C / 0 = inf -> 1
    clipped = [t.to(sum_dtype(t)) * factor for t in tensors]
    return clipped, factor, norm <= max_norm
