"""What each client keeps between rounds, off the compute device: the client-state store.

SCAFFOLD's and PAdaMFed's ``c_i`` and FedDyn's ``g_i`` are one tensor per model parameter per
client. A run of thousands of clients cannot hold them on a GPU, and need not hold them in memory
at all: only the sampled clients' entries are read each round, moved to the compute device for
their training, and written back. A store is a mapping ``client id -> tensors``:
``store[cid]`` reads a client's entry (fresh tensors on the run's device; ``KeyError`` for a
client that never trained, whose state is the rule's initial value), ``store[cid] = tensors``
writes it (exact bits, in the parameters' dtypes).

Two stores: ``MemoryClientState`` (``client_state_memory.py``: host memory, the default) and
``ClientStateFiles`` (``client_state_files.py``: files under a folder, ``fedopt-sim
--client-state-dir``), whose entries cost the process no memory between rounds.

Checkpoints (``checkpoint``/``committed``/``load``): a checkpoint records which entries are
current (the store's *position*) and copies only what changed since the previous one. The files
store keeps every entry a checkpoint names until the next checkpoint is in place, so a run killed
at any moment resumes from its last checkpoint with every client's state as it was then. The
memory store keeps a files store of its own beside the checkpoint (``client-state/`` in the
checkpoint folder) and writes the entries that changed into it.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set

import numpy as np
import torch

Tensors = List[torch.Tensor]


class ClientStateError(ValueError):
    """A store that cannot serve this run (another run's, model's or algorithm's; damaged), or a write
    that failed (full disk, no permission): the message names the path."""


class Layout:
    """One client's entry: a tensor per model parameter (shapes and dtypes of ``like``), as bytes."""

    def __init__(self, like: Sequence[torch.Tensor]):
        self.shapes = [tuple(t.shape) for t in like]
        self.dtypes = [t.dtype for t in like]
        self.sizes = [t.numel() * t.element_size() for t in like]
        self.offsets = [int(v) for v in np.concatenate([[0], np.cumsum(self.sizes)[:-1]])] if like else []
        self.nbytes = int(sum(self.sizes))

    def describe(self) -> List[str]:
        """``"(3, 2) torch.float32"`` per tensor: what a store's header records of the model."""
        return [f"{s} {d}" for s, d in zip(self.shapes, self.dtypes, strict=True)]

    def check(self, cid: int, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(self.shapes):
            raise ValueError(f"client {cid}'s state has {len(tensors)} tensors, the model {len(self.shapes)}")
        for j, (t, shape, dtype) in enumerate(zip(tensors, self.shapes, self.dtypes, strict=True)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"client {cid}'s state [{j}] is {tuple(t.shape)} {t.dtype}, the model's parameter {shape} {dtype}"
                )

    def pack(self, tensors: Sequence[torch.Tensor]) -> np.ndarray:
        """The entry's bytes (uint8), each tensor's in its own dtype, one after another."""
        out = np.empty(self.nbytes, dtype=np.uint8)
        for t, off, n in zip(tensors, self.offsets, self.sizes, strict=True):
            if n:
                raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                out[off : off + n] = raw.numpy()
        return out

    def unpack(self, raw: np.ndarray, device: torch.device) -> Tensors:
        """Tensors on ``device`` from ``pack``'s bytes (``raw`` is owned by them afterwards on the CPU)."""
        whole = torch.from_numpy(raw)
        out = []
        for shape, dtype, off, n in zip(self.shapes, self.dtypes, self.offsets, self.sizes, strict=True):
            t = whole[off : off + n].view(dtype).reshape(shape)
            out.append(t.to(device))
        return out


class ClientState(MutableMapping):
    """The store's interface (module docstring): a mapping ``client id -> tensors`` over the clients
    ``0 .. num_clients - 1``, read onto ``device``."""

    def __init__(self, layout: Layout, num_clients: int, device: torch.device):
        self.layout = layout
        self.num_clients = num_clients
        self.device = device
        self._changed: Set[int] = set()  # written since the last checkpoint

    def _check_id(self, cid: Any) -> int:
        if isinstance(cid, bool) or not isinstance(cid, (int, np.integer)) or not 0 <= cid < self.num_clients:
            raise KeyError(f"client id must be an integer in [0, {self.num_clients}), got {cid!r}")
        return int(cid)

    def start(self) -> None:
        """Begin a new run: no client holds anything."""
        raise NotImplementedError

    def prefetch(self, cids: Sequence[int]) -> None:
        """Say that these clients' entries are read soon (the files store asks the OS to read them ahead)."""

    def written_elsewhere(self, cids: Sequence[int]) -> None:
        """Another process of the run wrote these clients' entries (a store every rank shares)."""
        raise ClientStateError(f"{type(self).__name__} is not shared between processes")

    def copy_from(self, other: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Hold exactly ``other``'s entries (a validation run taking over its reference's state)."""
        self.start()
        for cid in sorted(other):
            self[cid] = other[cid]

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, folder: Path, identity: Dict[str, Any]) -> Dict[str, Any]:
        """Make this round's entries durable for a checkpoint in ``folder``; returns the position the
        checkpoint records. ``committed()`` follows once the checkpoint is in place."""
        raise NotImplementedError

    def committed(self) -> None:
        """The checkpoint whose position ``checkpoint`` returned is in place."""
        raise NotImplementedError

    def load(self, folder: Path, identity: Dict[str, Any], position: Dict[str, Any]) -> None:
        """Take back the entries a checkpoint in ``folder`` recorded (``position``)."""
        raise NotImplementedError


def entry_or_none(store: ClientState, cid: int) -> Optional[Tensors]:
    """Client ``cid``'s entry, or None before its first round."""
    return store[cid] if cid in store else None
