"""The client-state store in host memory (``client_state.py``), the default: each client's tensors
copied off the compute device, and a store in files of its own beside each checkpoint
(``client-state/`` in the checkpoint folder), into which a checkpoint writes only the entries
that changed since the one before."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Set

import torch

from .client_state import ClientState, ClientStateError, Layout, Tensors
from .client_state_files import ClientStateFiles

MIRROR = "client-state"  # the memory store's files, in the checkpoint folder


class MemoryClientState(ClientState):
    """Entries in host memory (the default store): each client's tensors, copied off the device."""

    def __init__(self, layout: Layout, num_clients: int, device: torch.device):
        super().__init__(layout, num_clients, device)
        self._entries: Dict[int, Tensors] = {}
        self._mirror: Optional[Any] = None  # ClientStateFiles beside the checkpoint
        self._mirror_pending: Set[int] = set()

    def start(self) -> None:
        self._entries.clear()
        self._changed.clear()
        self._mirror = None

    def __getitem__(self, cid: int) -> Tensors:
        entry = self._entries[self._check_id(cid)]
        return [t.to(self.device, copy=True) for t in entry]

    def __setitem__(self, cid: int, tensors: Sequence[torch.Tensor]) -> None:
        cid = self._check_id(cid)
        self.layout.check(cid, tensors)
        self._entries[cid] = [t.detach().to("cpu", copy=True) for t in tensors]
        self._changed.add(cid)

    def __delitem__(self, cid: int) -> None:
        del self._entries[self._check_id(cid)]
        self._changed.add(cid)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, cid: object) -> bool:
        return cid in self._entries

    def checkpoint(self, folder: Path, identity: Dict[str, Any]) -> Dict[str, Any]:
        mirror = self._mirror
        if mirror is None or mirror.folder != folder / MIRROR:
            mirror = ClientStateFiles(
                folder / MIRROR, self.layout, self.num_clients, identity, self.device, mirror=True
            )
            mirror.start()
            changed = set(self._entries) | self._changed
        else:
            changed = set(self._changed)
        for cid in sorted(changed):
            if cid in self._entries:
                mirror[cid] = self._entries[cid]
            elif cid in mirror:
                del mirror[cid]
        position = {**mirror.checkpoint(folder, identity), "kind": "memory"}
        self._mirror, self._mirror_pending = mirror, changed
        return position

    def committed(self) -> None:
        if self._mirror is not None:
            self._mirror.committed()
        self._changed -= self._mirror_pending
        self._mirror_pending = set()

    def load(self, folder: Path, identity: Dict[str, Any], position: Dict[str, Any]) -> None:
        if position.get("kind", "memory") != "memory":
            raise ClientStateError(
                f"the checkpoint in {folder} kept its clients' state in files ({position.get('folder')}); this "
                f"run keeps it in host memory: resume with the same client-state folder"
            )
        mirror = ClientStateFiles(
            folder / MIRROR, self.layout, self.num_clients, identity, torch.device("cpu"), mirror=True
        )
        mirror.load(folder, identity, position)  # ClientStateError before anything changes here
        entries = {cid: mirror[cid] for cid in mirror}
        self._entries = entries
        self._changed.clear()
        self._mirror, self._mirror_pending = mirror, set()
