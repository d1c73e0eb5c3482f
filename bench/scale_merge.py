"""The merge's extra memory on one rank (``python -m bench scale --parts merge`` runs this under torchrun).

``python -m torch.distributed.run --nproc-per-node W bench/scale_merge.py OUT N``: every rank holds
sums of ``N`` float64 numbers (two tensors, as SCAFFOLD's model and control sums), and combines them
three ways, each after the last has freed its memory: ``Ranks.merge``'s chunked sum in rank order
(the simulator's), the same sum with every rank's whole sums gathered at once (what the merge did
before: a flat copy, ``W`` gathered copies, their total), and ``torch.distributed.all_reduce``
(a user's alternative; its order of addition is gloo's or NCCL's, not fixed by rank). The extra
memory of each is this process's peak resident set during it (``VmHWM``, reset before) minus the
resident set before it. Each rank writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from fedopt_kernels.sim.ranks import Ranks


def _status() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _extra(run: Callable[[], None]) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    before = _status()["VmRSS"]
    run()
    return _status()["VmHWM"] - before


def _gather_all(ranks: Ranks, sums: List[torch.Tensor]) -> None:
    flat = torch.cat([t.reshape(-1) for t in sums])
    parts = [torch.empty_like(flat) for _ in range(ranks.world)]
    dist.all_gather(parts, flat)
    total = parts[0].clone()
    for p in parts[1:]:
        total.add_(p)
    at = 0
    for t in sums:
        t.copy_(total[at : at + t.numel()].view_as(t))
        at += t.numel()


def main() -> int:
    out, n = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    ranks = Ranks.from_environment("cpu")
    half = n // 2
    sums = [torch.rand(half, dtype=torch.float64), torch.rand(n - half, dtype=torch.float64)]

    def all_reduce() -> None:
        for t in sums:
            dist.all_reduce(t)

    ways: Dict[str, Callable[[], None]] = {
        "merge (chunked, rank order)": lambda: ranks._sum_in_rank_order(sums),
        "whole sums gathered (before)": lambda: _gather_all(ranks, sums),
        "all_reduce": all_reduce,
    }
    extra: Dict[str, int] = {}
    for name, run in ways.items():
        ranks.barrier()
        extra[name] = _extra(run)
    record = {"world": ranks.world, "sums_bytes": n * 8, "extra_bytes": extra}
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(record))
    ranks.barrier()
    ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
