"""A client's data (train/val/test tensors) and its seeded stream of mini-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple

import numpy as np
import torch

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class ClientData:
    """One user's data, already on the simulation's device. ``size`` (train samples) weights aggregation."""

    client_id: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.train_y.shape[0])


class BatchStream:
    """Endless mini-batches of one split: shuffle, walk through, reshuffle (epochs without replacement).

    The order depends only on the generator it was given, never on the optimizer backend, so two runs
    with the same seed see the same batches (what ``--validate`` relies on). A batch never spans two
    epochs: the last batch of an epoch may be smaller.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, rng: np.random.Generator):
        if y.shape[0] == 0:
            raise ValueError("BatchStream needs at least one sample")
        self.x, self.y, self.batch_size, self.rng = x, y, batch_size, rng
        self.pending: List[int] = []  # the rest of this epoch's shuffled indices (checkpointed)

    def next_indices(self) -> List[int]:
        """The sample indices of the next batch (what ``next`` returns the samples of)."""
        if not self.pending:
            self.pending = self.rng.permutation(self.y.shape[0]).tolist()
        take, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size :]
        return take

    def next(self) -> Batch:
        idx = torch.tensor(self.next_indices(), dtype=torch.long, device=self.y.device)
        return self.x[idx], self.y[idx]

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next()
