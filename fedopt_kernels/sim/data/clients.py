"""A client's data (train/val/test tensors) and its seeded stream of mini-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Sequence, Tuple

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

    def skip(self, batches: int) -> None:
        """Move on by ``batches`` batches without taking them (another process trained this client)."""
        for _ in range(batches):
            self.next_indices()

    def next(self) -> Batch:
        idx = torch.tensor(self.next_indices(), dtype=torch.long, device=self.y.device)
        return self.x[idx], self.y[idx]

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next()


class BatchStreams(Mapping[int, BatchStream]):
    """Every training client's ``BatchStream``, by client id, each made when first asked for.

    Client ``i``'s generator is child ``i`` of ``seed`` (what ``seed.spawn(len(clients))[i]`` gives),
    so a run's batches do not depend on when, or whether, a stream was made, and a population of
    100,000 clients costs nothing until its clients train. ``made()``: the ids of the streams that
    exist (what a checkpoint saves; the others are still at their start).
    """

    def __init__(self, clients: Sequence[ClientData], batch_size: int, seed: np.random.SeedSequence):
        self.clients, self.batch_size, self.seed = clients, batch_size, seed
        self._made: Dict[int, BatchStream] = {}

    def _rng(self, cid: int) -> np.random.Generator:
        s = self.seed
        return np.random.default_rng(
            np.random.SeedSequence(s.entropy, spawn_key=(*s.spawn_key, cid), pool_size=s.pool_size)
        )

    def __getitem__(self, cid: int) -> BatchStream:
        stream = self._made.get(cid)
        if stream is None:
            if not 0 <= cid < len(self.clients):
                raise KeyError(cid)
            c = self.clients[cid]
            stream = self._made[cid] = BatchStream(c.train_x, c.train_y, self.batch_size, self._rng(cid))
        return stream

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.clients)))

    def __len__(self) -> int:
        return len(self.clients)

    def made(self) -> List[int]:
        return sorted(self._made)

    def forget(self) -> None:
        """Back to the start: every stream made anew when next asked for."""
        self._made.clear()
