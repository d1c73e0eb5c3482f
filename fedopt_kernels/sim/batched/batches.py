"""A round's mini-batches for many clients at once: drawn as the sequential run draws them, padded, stacked.

Client ``c`` takes its ``K`` batches from its own ``BatchStream`` (same generator, same order as
when it trains alone), so seeds, sampling and batch order are those of the sequential run. Batches
differ in size (a client with fewer samples than the batch size, the last batch of an epoch): each
is padded to the batch size ``B`` with copies of one of its own samples, and the sample weights
are ``1/n`` on the ``n`` real samples and 0 on the copies, so the weighted loss is the mean over
the real samples, as ``F.cross_entropy`` computes it sequentially. All clients' training data sit
in one pooled tensor, so a round's ``[K, C, B, ...]`` inputs come from one gather.

Clients whose step counts differ (``K_c``, K their largest) draw exactly their own ``K_c`` batches;
their steps after ``K_c`` repeat their last batch (valid inputs for a step in which they are
inactive, never drawn from their stream).

A random input stage (augmentation) must draw the same random numbers as sequentially: it is then
applied batch by batch, client after client, on the real samples only; a deterministic stage runs
once on the whole gathered tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..data.clients import BatchStream, ClientData

Stage = Callable[[torch.Tensor, bool], torch.Tensor]


@dataclass
class RoundBatches:
    """Inputs of K local steps of C clients: ``x`` [K, C, B, ...], ``y`` [K, C, B], ``w`` [K, C, B]."""

    x: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor
    counts: torch.Tensor  # [K, C] real samples per batch (host, int64)
    anchor_x: Optional[torch.Tensor] = None  # PAdaMFed-VR: the anchor model's own view of the batches
    steps: Optional[List[int]] = None  # each client's own step count K_c where they differ (else K for all)


class BatchPool:
    """The training splits of ``clients`` pooled on their device, indexed by client id.

    ``dtype``: of the sample weights (the model's: ``1/n`` rounded as the sequential mean rounds it).
    """

    def __init__(self, clients: Sequence[ClientData], batch_size: int, dtype: torch.dtype = torch.float32):
        if not clients:
            raise ValueError("BatchPool needs at least one client")
        self.batch_size = batch_size
        self.dtype = dtype
        self.x = torch.cat([c.train_x for c in clients])
        self.y = torch.cat([c.train_y for c in clients])
        sizes = [c.size for c in clients]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.start: Dict[int, int] = {c.client_id: int(s) for c, s in zip(clients, starts, strict=True)}

    def draw(
        self, streams: Mapping[int, BatchStream], cids: Sequence[int], steps: Union[int, Sequence[int]]
    ) -> RoundBatches:
        """The next ``steps`` batches of every client in ``cids`` from its stream, padded and gathered;
        ``steps``: one count for all, or each client's own (the module docstring: the shorter repeat
        their last batch up to the largest)."""
        own = [steps] * len(cids) if isinstance(steps, int) else [int(k) for k in steps]
        steps = max(own)
        B, C = self.batch_size, len(cids)
        idx = np.empty((steps, C, B), dtype=np.int64)
        counts = np.empty((steps, C), dtype=np.int64)
        for c, cid in enumerate(cids):
            stream = streams[cid]
            for k in range(own[c]):
                take = stream.next_indices()
                n = len(take)
                idx[k, c, :n] = take
                idx[k, c, n:] = take[0]  # padding: copies of a real sample (finite activations)
                counts[k, c] = n
            idx[own[c] :, c] = idx[own[c] - 1, c]
            counts[own[c] :, c] = counts[own[c] - 1, c]
        idx += np.array([self.start[cid] for cid in cids], dtype=np.int64)[None, :, None]
        device = self.y.device
        flat = torch.from_numpy(idx).to(device).view(-1)
        x = self.x[flat].view(steps, C, B, *self.x.shape[1:])
        y = self.y[flat].view(steps, C, B)
        sizes = torch.from_numpy(counts)
        real = torch.arange(B)[None, None, :] < sizes[..., None]
        w = (real.to(self.dtype) / sizes[..., None].to(self.dtype)).to(device)
        return RoundBatches(x, y, w, sizes, steps=None if min(own) == steps else own)


def apply_stage(stage: Optional[Stage], batches: RoundBatches, random: bool, train: bool = True) -> torch.Tensor:
    """The model inputs of ``batches``: ``stage(x, train)`` (None: x itself).

    ``random``: the stage draws random numbers (augmentation); it then sees each client's real
    samples of each step separately, clients in order, as in the sequential run.
    """
    x = batches.x
    if stage is None:
        return x
    K, C, B = x.shape[:3]
    if not random:
        flat = stage(x.reshape(K * C * B, *x.shape[3:]), train)
        return flat.view(K, C, B, *flat.shape[1:])
    out: Optional[torch.Tensor] = None
    counts = batches.counts.tolist()
    own = batches.steps or [K] * C
    for c in range(C):
        for k in range(K):
            if k >= own[c]:  # a step after the client's last: inactive, its inputs a copy (no draw)
                assert out is not None  # set at the client's first step
                out[k, c] = out[own[c] - 1, c]
                continue
            n = counts[k][c]
            part = stage(x[k, c, :n], train)
            if out is None:
                out = part.new_empty((K, C, B) + tuple(part.shape[1:]))
            out[k, c, :n] = part
            out[k, c, n:] = part[:1]
    assert out is not None  # a round has at least one step and one client
    return out
