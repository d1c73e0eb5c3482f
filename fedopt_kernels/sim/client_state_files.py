"""The client-state store in files (``fedopt-sim --client-state-dir DIR``): entries off the process's memory.

A folder holds one run's store:

* ``store.json``, the header: the run it belongs to (its settings, as a checkpoint records them),
  the model's tensors (shapes and dtypes), the number of clients, the layout of the files, and a
  token that a new run replaces;
* ``block-<b>.bin``: the entries of clients ``64 b .. 64 b + 63``, two slots per client, each slot
  one entry's bytes (every parameter's, in its dtype: exact bits) rounded up to 4 KiB. The files are
  sparse: a client that never trained takes no disk space.

Which slot holds a client's entry is the store's *position* (one byte per client, -1: none), kept
in memory and recorded by each checkpoint. A write goes to the slot the last checkpoint does not
name, so the entries of the position a checkpoint recorded stay intact until the next checkpoint
is in place: a run killed at any moment (in a write included) resumes from its last checkpoint
with every client's state as it was. Without checkpoints, a write goes to the slot that does not
hold the client's current entry, which stays until the new one is written whole.

Writes go through ``os.pwrite``, reads through a memory map of the entry (``numpy.memmap``) copied
onto the run's device. A write that fails (a full disk, a read-only folder) raises
``ClientStateError`` naming the path; the store then refuses further use, and whatever a checkpoint
recorded is intact. Writing through the map instead would turn a full disk into a SIGBUS that
kills the process.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Set

import numpy as np
import torch

from ..fl.checkpoint import plain_settings, settings_diff, write_text_atomic
from .client_state import ClientState, ClientStateError, Layout, Tensors

FORMAT = "fedopt_kernels client state"
VERSION = 1
HEADER = "store.json"
BLOCK = 64  # clients per file
PAGE = 4096
_OPEN_FILES = 32  # open block files kept at once


def _page_round(n: int) -> int:
    return max(PAGE, -(-n // PAGE) * PAGE)


class ClientStateFiles(ClientState):
    """The store in ``folder`` (module docstring). ``identity``: the run's settings; a store whose header
    names other settings, another model or another number of clients is refused, naming the path and
    each difference (not for ``mirror``, the memory store's copy beside a checkpoint). Nothing is
    written until ``start`` (a new run) or ``load`` (a resumed one)."""

    def __init__(
        self,
        folder: Path,
        layout: Layout,
        num_clients: int,
        identity: Dict[str, Any],
        device: torch.device,
        mirror: bool = False,
    ):
        super().__init__(layout, num_clients, device)
        self.folder = Path(folder)
        self.slot_bytes = _page_round(layout.nbytes)
        self.identity = plain_settings(identity)
        self.current = np.full(num_clients, -1, dtype=np.int8)
        self.pinned = np.full(num_clients, -1, dtype=np.int8)  # the slots the last checkpoint names
        self.token: Optional[str] = None  # set by start / load
        self._fds: Dict[int, int] = {}  # block -> open file (most recently used last)
        self._dirty: Set[int] = set()  # blocks written since the last flush
        self._broken: Optional[str] = None
        self.mirror = mirror  # the memory store's copy beside a checkpoint: started anew, not checked
        if not mirror:
            self._check_header()

    # ------------------------------------------------------------------ the header
    def _header(self) -> Dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "token": self.token,
            "training clients": self.num_clients,
            "tensors": self.layout.describe(),
            "slot_bytes": self.slot_bytes,
            "block": BLOCK,
            "run": self.identity,
        }

    def _read_header(self) -> Optional[Dict[str, Any]]:
        path = self.folder / HEADER
        if self.folder.exists() and not self.folder.is_dir():
            raise ClientStateError(f"client state folder {self.folder} is a file, not a folder")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ClientStateError(f"cannot read the client state header {path}: {exc.strerror}") from None
        try:
            head = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClientStateError(f"client state header {path} is damaged ({exc})") from None
        if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != VERSION:
            raise ClientStateError(f"{path} is not a fedopt_kernels client state header (version {VERSION})")
        return head

    def _check_header(self) -> None:
        head = self._read_header()
        if head is None:
            return
        mine = self._header()
        diff = []
        for key in ("training clients", "tensors", "slot_bytes", "block"):
            if head.get(key) != mine[key]:
                diff.append(f"{key}: {head.get(key)!r} in the store, {mine[key]!r} now")
        run = head.get("run")
        saved: Dict[str, Any] = run if isinstance(run, dict) else {}
        diff += settings_diff(saved, self.identity, saved_in="the store")
        if diff:
            raise ClientStateError(
                f"the client state in {self.folder} belongs to another run; it cannot serve this one. "
                f"Differences: " + "; ".join(diff) + ". Give another folder, or delete this one"
            )

    # ------------------------------------------------------------------ files
    def _path(self, block: int) -> Path:
        return self.folder / f"block-{block:06d}.bin"

    def _fd(self, block: int, create: bool) -> Optional[int]:
        fd = self._fds.pop(block, None)
        if fd is None:
            while len(self._fds) >= _OPEN_FILES:  # room first: a failure below leaves no descriptor open
                old_block, old = next(iter(self._fds.items()))
                del self._fds[old_block]
                try:
                    if old_block in self._dirty:
                        os.fsync(old)
                        self._dirty.discard(old_block)
                finally:
                    os.close(old)
            # no ftruncate to the block's size: a write past the end extends the file (sparse: the
            # slots before it take no disk space), so a full disk or a size limit fails the write itself
            try:
                fd = os.open(self._path(block), os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
            except FileNotFoundError:
                if create:
                    raise
                return None
        self._fds[block] = fd  # most recently used last
        return fd

    def _where(self, cid: int, slot: int) -> tuple[int, int]:
        block, k = divmod(cid, BLOCK)
        return block, (2 * k + slot) * self.slot_bytes

    def _usable(self) -> None:
        if self._broken is not None:
            raise ClientStateError(self._broken)
        if self.token is None:
            raise ClientStateError(f"the client state in {self.folder} is not started (start() or load() first)")

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ the mapping
    def start(self) -> None:
        """A new run: a new token in the header, no client holding anything (the files of an earlier
        run in this folder, which this run replaces, are deleted)."""
        self.close()
        self.token = uuid.uuid4().hex
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for f in self.folder.glob("block-*.bin"):
                f.unlink()
            write_text_atomic(self.folder / HEADER, json.dumps(self._header(), indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            self.token = None
            raise ClientStateError(f"cannot write the client state in {self.folder}: {exc.strerror or exc}") from None
        self.current[:] = -1
        self.pinned[:] = -1
        self._dirty.clear()
        self._changed.clear()
        self._broken = None

    def join(self, token: str) -> None:
        """Begin the run that another process of it has just ``start``-ed here (its token): the same
        empty position, nothing written."""
        self.close()
        self.token = token
        self.current[:] = -1
        self.pinned[:] = -1
        self._dirty.clear()
        self._changed.clear()
        self._broken = None

    def written_elsewhere(self, cids: Sequence[int]) -> None:
        """Another process wrote these clients' entries, each into the slot this one would have
        chosen (``_target`` depends only on the position, which every process keeps the same)."""
        for cid in cids:
            cid = self._check_id(cid)
            self.current[cid] = self._target(cid)
            self._changed.add(cid)

    def _target(self, cid: int) -> int:
        cur, pin = int(self.current[cid]), int(self.pinned[cid])
        if pin < 0:
            return 1 if cur == 0 else 0  # never over the current entry
        if cur < 0 or cur == pin:  # deleted since the checkpoint, or not written since: the other slot
            return 1 - pin
        return cur  # written since the checkpoint: its slot again, the checkpoint's stays

    def __setitem__(self, cid: int, tensors: Sequence[torch.Tensor]) -> None:
        cid = self._check_id(cid)
        self._usable()
        self.layout.check(cid, tensors)
        raw = memoryview(self.layout.pack(tensors).data)
        slot = self._target(cid)
        block, offset = self._where(cid, slot)
        path = self._path(block)
        try:
            fd = self._fd(block, create=True)
            assert fd is not None
            done = 0
            while done < len(raw):
                done += os.pwrite(fd, raw[done:], offset + done)
        except OSError as exc:
            self._broken = (
                f"writing client {cid}'s state to {path} failed ({exc.strerror or exc}); the client state in "
                f"{self.folder} is not usable further (every entry a checkpoint recorded is intact)"
            )
            raise ClientStateError(self._broken) from None
        self.current[cid] = slot
        self._dirty.add(block)
        self._changed.add(cid)

    def __getitem__(self, cid: int) -> Tensors:
        cid = self._check_id(cid)
        slot = int(self.current[cid])
        if slot < 0:
            raise KeyError(cid)
        self._usable()
        block, offset = self._where(cid, slot)
        n = self.layout.nbytes
        if n == 0:
            return self.layout.unpack(np.empty(0, dtype=np.uint8), self.device)
        try:
            mapped = np.memmap(self._path(block), dtype=np.uint8, mode="r", offset=offset, shape=(n,))
            raw = np.array(mapped)  # the copy the tensors own; the map goes with ``mapped``
            del mapped
        except OSError as exc:
            raise ClientStateError(f"reading client {cid}'s state from {self._path(block)} failed: {exc}") from None
        return self.layout.unpack(raw, self.device)

    def __delitem__(self, cid: int) -> None:
        cid = self._check_id(cid)
        if self.current[cid] < 0:
            raise KeyError(cid)
        self.current[cid] = -1
        self._changed.add(cid)

    def __iter__(self) -> Iterator[int]:
        return iter(int(i) for i in np.flatnonzero(self.current >= 0))

    def __len__(self) -> int:
        return int((self.current >= 0).sum())

    def __contains__(self, cid: object) -> bool:
        return bool(isinstance(cid, (int, np.integer)) and 0 <= cid < self.num_clients and self.current[cid] >= 0)

    def prefetch(self, cids: Sequence[int]) -> None:
        advise = getattr(os, "posix_fadvise", None)
        if advise is None or self.token is None:
            return
        for cid in cids:
            slot = int(self.current[cid])
            if slot >= 0:
                block, offset = self._where(cid, slot)
                fd = self._fd(block, create=False)
                if fd is not None:
                    with contextlib.suppress(OSError):
                        advise(fd, offset, self.layout.nbytes, os.POSIX_FADV_WILLNEED)

    # ------------------------------------------------------------------ checkpoints
    def flush(self) -> None:
        """Every write so far on disk (``fsync``)."""
        self._usable()
        try:
            for block in sorted(self._dirty):
                fd = self._fd(block, create=False)
                if fd is not None:
                    os.fsync(fd)
        except OSError as exc:
            raise ClientStateError(f"saving the client state in {self.folder} failed: {exc.strerror or exc}") from None
        self._dirty.clear()

    def checkpoint(self, folder: Path, identity: Dict[str, Any]) -> Dict[str, Any]:
        self.flush()
        return {
            "kind": "files",
            "folder": str(self.folder),
            "token": self.token,
            "current": torch.from_numpy(self.current.copy()),
        }

    def committed(self) -> None:
        self.pinned[:] = self.current
        self._changed.clear()

    def load(self, folder: Path, identity: Dict[str, Any], position: Dict[str, Any]) -> None:
        head = self._read_header()
        current = position.get("current")
        token = position.get("token")
        if (position.get("kind") == "memory") != self.mirror:
            raise ClientStateError(
                f"the checkpoint in {folder} kept its clients' state in host memory; this run keeps it in "
                f"{self.folder}: resume without a client-state folder"
                if not self.mirror
                else f"the checkpoint in {folder} kept its clients' state in files, not in host memory"
            )
        if head is None:
            raise ClientStateError(f"the checkpoint in {folder} names client state in {self.folder}, which holds none")
        if head.get("token") != token:
            raise ClientStateError(
                f"the client state in {self.folder} is not the one the checkpoint in {folder} recorded: "
                f"another run has started in it since"
            )
        if not isinstance(current, torch.Tensor) or current.dtype != torch.int8 or current.numel() != self.num_clients:
            raise ClientStateError(f"the checkpoint in {folder} records a client-state position of another run")
        values = current.numpy()
        if not np.isin(values, (-1, 0, 1)).all():
            raise ClientStateError(f"the checkpoint in {folder} records a damaged client-state position")
        self.close()
        self.token = str(token)
        self.current[:] = values
        self.pinned[:] = values
        self._dirty.clear()
        self._changed.clear()
        self._broken = None


def clear(folder: Path) -> None:
    """Delete the store in ``folder`` (its header and files, nothing else): a new run replaces it."""
    folder = Path(folder)
    for f in [folder / HEADER, *folder.glob("block-*.bin")]:
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
