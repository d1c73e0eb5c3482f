"""The client-batched engine under user-level DP: a chunk's replies clipped and summed by one op.

The engine hands its clients' updates over one at a time (``BatchedClients.train``'s ``take``);
``ChunkClip`` copies each accepted update (its ``delta`` and the rule's reply tensors: the whole
reply, one vector) into row c of ``[C, *shape]`` buffers kept for the run, and at the chunk's end
(``flush``) one multi-tensor op computes every client's norm, clip factor and adaptive-clip bit
and the clipped sum (``DPFedAvg.clip_sum``, ``fedopt_kernels.core.clip_sum``), which the fold adds
for all of them at once (``Fold.add_sum``). The sequential engine clips reply by reply
(``DPFedAvg.clip_reply``).

Both compute the same clipped sum; they differ in the order of the float64 additions (a chunk's
clients are added in order into a sum of their own, which the fold then adds), so a round's
aggregate agrees with the reply-by-reply path to float64 rounding (a few 2**-53 of the summed
magnitudes), and a run is reproducible bit for bit (the chunks are fixed by the run's settings).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..core.clip_sum import backends_with_kernel
from ..fl.fold import Fold
from ..privacy.dp_fedavg import DPFedAvg
from .strategy import ClientUpdate


class ChunkClip:
    """A chunk's accepted replies, stacked as they arrive, then clipped and folded by ``flush``."""

    def __init__(self, dp: DPFedAvg, names: Sequence[str], backend: str):
        self.dp, self.names, self.backend = dp, tuple(names), backend
        self.buffers: Optional[List[torch.Tensor]] = None  # [C, *shape]: the delta's tensors, then each reply's
        self.lengths: List[int] = []  # tensors of the delta, then of each reply entry
        self.rows = 0  # accepted replies in the chunk so far

    def take(self, update: ClientUpdate, size: int) -> None:
        """Stack an accepted (screened) update into the next row; ``size``: the engine's chunk size."""
        parts = [list(update.delta)] + [list(update.extra[n]) for n in self.names]
        flat = [t for part in parts for t in part]
        if self.buffers is None or self.buffers[0].shape[0] < size:
            self.buffers = [t.new_empty((size, *t.shape)) for t in flat]
            self.lengths = [len(part) for part in parts]
            if self.backend != "auto" and backends_with_kernel(flat[0].device)[self.backend] is not None:
                self.backend = "auto"  # the run's backend has no clip_sum here: the device's best one
        with torch.no_grad():
            for buf, t in zip(self.buffers, flat, strict=True):
                buf[self.rows].copy_(t)
        self.rows += 1

    def flush(self, fold: Fold) -> None:
        """Clip and sum the chunk's accepted replies (one op) and add them to ``fold``."""
        m, self.rows = self.rows, 0
        if m == 0 or self.buffers is None:
            return
        rows = [b[:m] for b in self.buffers]  # the first m rows: contiguous views
        parts, at = [], 0
        for n in self.lengths:
            parts.append(rows[at : at + n])
            at += n
        delta, reply = self.dp.clip_sum(
            parts[0], dict(zip(self.names, parts[1:], strict=True)), self.names, self.backend
        )
        fold.add_sum(delta, m, reply)
