"""One simulation on several processes: torchrun's ranks, the split of a round, the combination of the sums.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment) every process
builds the same run from the same settings: the same data, model, sampled clients and batch
streams. A round's sampled clients are divided among the ranks (``split``: by their work, the
same way on every rank), each rank trains its share and folds its updates, and the partial sums
are combined in rank order (``merge``), so every rank finishes the round with the same global
model and server state, bit for bit. ``Ranks.single()`` is the run on one process: nothing is
sent and every method is the identity.

Collectives go through ``torch.distributed``: gloo on CPUs, NCCL on GPUs (rank r on GPU
``LOCAL_RANK``). Tensors are combined with ``all_gather``, one chunk of the sums at a time (each rank
receives every rank's part of the chunk and adds them in rank order itself: a reduction whose order
is fixed, whose memory does not grow with the ranks); small Python data (which clients were refused,
their losses) with ``all_gather_object``.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from ..fl.fold import Fold
from ..fl.server_rules import InitialFold

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# the merge's chunks per rank: its extra memory is about (2 world + 1) / (CHUNKS_PER_RANK world) of
# the sums (Ranks._sum_in_rank_order), more collectives for less memory
CHUNKS_PER_RANK = 4


class RankMismatch(RuntimeError):
    """The ranks of one run hold different models or server states: the run cannot go on."""


class Ranks:
    """The processes of one run (module docstring). ``rank``, ``world`` (their number), ``local``
    (this process's index on its machine: its GPU)."""

    def __init__(self, rank: int = 0, world: int = 1, local: int = 0, group: Any = None):
        self.rank, self.world, self.local, self.group = rank, world, local, group

    @classmethod
    def single(cls) -> Ranks:
        return cls()

    @classmethod
    def from_environment(cls, device: str = "auto", timeout_s: float = 1800.0) -> Ranks:
        """torchrun's ranks, with the process group started (gloo, or NCCL for a CUDA run); one rank
        when the environment names none."""
        if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
            return cls.single()
        import torch.distributed as dist

        missing = [k for k in ENV if k not in os.environ]
        if missing:
            raise ValueError(f"WORLD_SIZE is set but {', '.join(missing)} is not: start the run with torchrun")
        rank, world, local = (int(os.environ[k]) for k in ENV)
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            backend, timeout = "nccl" if cuda else "gloo", timedelta(seconds=timeout_s)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            if attempt is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                # torchrun keeps its store across restarts of the workers: the addresses the ranks of an
                # earlier attempt published there would be found again (a refused connection), so each
                # attempt's group keeps its keys under a prefix of its own
                agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                store = dist.TCPStore(
                    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, not agent and rank == 0, timeout
                )
                prefixed = dist.PrefixStore(f"fedopt_kernels/attempt-{attempt}", store)
                dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
        return cls(rank, world, local, dist.group.WORLD)

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        """This rank's device: its own GPU (``LOCAL_RANK``) for a CUDA run."""
        if self.world > 1 and device.type == "cuda":
            return torch.device("cuda", self.local)
        return device

    # ------------------------------------------------------------------ dividing the work
    def split(self, clients: Sequence[int], work: Callable[[int], float], t: int = 0) -> List[List[int]]:
        """Each rank's share of round ``t``'s ``clients``, balanced by ``work``: the largest first, each
        to the rank with the least so far (ties: the lower client id; among ranks, the first from rank
        ``t % world`` on, so that no rank takes every round's odd client); a share is in client order.
        Depends on nothing but its inputs, so every rank computes the same split."""
        shares: List[List[int]] = [[] for _ in range(self.world)]
        load = [0.0] * self.world
        for cid in sorted(clients, key=lambda c: (-work(c), c)):
            r = min(range(self.world), key=lambda i: (load[i], (i - t) % self.world))
            shares[r].append(cid)
            load[r] += work(cid)
        return [sorted(s) for s in shares]

    def block(self, n: int) -> Tuple[int, int]:
        """This rank's contiguous block ``[lo, hi)`` of ``n`` items (the first ``n % world`` ranks one more)."""
        base, extra = divmod(n, self.world)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    # ------------------------------------------------------------------ combining
    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _sum_in_rank_order(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace each of ``tensors`` by its sum over the ranks, added in rank order (``p_0 + p_1 + ...``,
        element by element, the same on every rank), in place. The tensors of one dtype are taken as
        one flat sequence of ``n`` numbers in chunks of ``c = ceil(n / (4 world))``: each chunk is
        gathered from every rank and added, so the extra memory is the chunk sent, the ``world``
        chunks received and gloo's flat copy of them, ``(2 world + 1) c``: about ``n / 2`` numbers,
        whatever the number of ranks (bench/scale_merge.py measures it)."""
        import torch.distributed as dist

        for idx in _by_dtype(tensors):
            group = [tensors[i] for i in idx]
            n = sum(t.numel() for t in group)
            if n == 0:
                continue
            chunk = -(-n // (CHUNKS_PER_RANK * self.world))
            send = torch.zeros(chunk, dtype=group[0].dtype, device=group[0].device)
            got = [torch.empty_like(send) for _ in range(self.world)]
            for lo in range(0, n, chunk):
                m = min(chunk, n - lo)
                _copy_span(group, lo, send[:m], out=True)
                dist.all_gather(got, send, group=self.group)
                send.copy_(got[0])
                for part in got[1:]:  # rank order
                    send.add_(part)
                _copy_span(group, lo, send[:m], out=False)

    def merge(self, fold: Fold) -> None:
        """Make ``fold`` hold every rank's sums, counts and weights, added in rank order."""
        if self.world == 1:
            return
        self._sum_in_rank_order([t for name in sorted(fold.sums) for t in fold.sums[name]])
        counts = self.gather((fold.count, fold.weight))
        fold.count = sum(c for c, _ in counts)
        weight = 0.0
        for _, w in counts:  # rank order
            weight += w
        fold.weight = weight

    def merge_initial(self, fold: InitialFold) -> None:
        """``merge`` for the sum of the clients' first controls."""
        if self.world == 1:
            return
        self._sum_in_rank_order(fold.total)
        fold.count = sum(self.gather(fold.count))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def check_same(self, parts: Dict[str, Any], when: str) -> None:
        """``RankMismatch`` unless every rank's ``parts`` (name -> a digest, or small plain data such
        as a list of client sizes or a dict of settings) equal rank 0's; its message names each rank
        that differs, each part, and for a list or a dict the first item or the keys that differ."""
        every = self.gather(parts)
        lines = []
        for r, theirs in enumerate(every[1:], start=1):
            for name, mine in every[0].items():
                if theirs.get(name) != mine:
                    lines.append(f"rank {r} differs from rank 0 in {name}{_difference(mine, theirs.get(name))}")
        if lines:
            raise RankMismatch(
                f"the ranks of this run disagree {when}: " + "; ".join(lines) + ". They would not compute "
                "the same run, so it stops (a rank with other settings, data or code, or a nondeterministic kernel)"
            )

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """The SHA-256 of ``tensors`` (their bytes, shapes and dtypes), 16 hex digits."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _difference(mine: Any, theirs: Any) -> str:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        return " (" + ", ".join(f"{k}: {mine.get(k)!r} on rank 0, {theirs.get(k)!r} there" for k in keys[:5]) + ")"
    if isinstance(mine, list) and isinstance(theirs, list):
        if len(mine) != len(theirs):
            return f" ({len(mine)} on rank 0, {len(theirs)} there)"
        i = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        return f" (first at index {i}: {mine[i]!r} on rank 0, {theirs[i]!r} there)"
    return f" ({mine} on rank 0, {theirs} there)"


def _by_dtype(tensors: Sequence[torch.Tensor]) -> List[List[int]]:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _copy_span(tensors: Sequence[torch.Tensor], start: int, flat: torch.Tensor, out: bool) -> None:
    """Numbers ``[start, start + len(flat))`` of ``tensors`` taken as one flat sequence: copied into
    ``flat`` (``out``) or from it."""
    at, done = 0, 0
    for t in tensors:
        n = t.numel()
        if at + n > start + done and done < flat.numel():
            lo = start + done - at
            k = min(n - lo, flat.numel() - done)
            view = t.view(-1)[lo : lo + k]  # every sum tensor is contiguous: a view, written through
            if out:
                flat[done : done + k].copy_(view)
            else:
                view.copy_(flat[done : done + k])
            done += k
        at += n
