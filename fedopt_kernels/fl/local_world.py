"""Run a function on every rank of a small CPU process group (gloo) on this machine, one process per rank.

``run_local_world(fn, n, *args)`` starts ``n`` processes with ``torch.multiprocessing`` (spawn),
joins them into a gloo group through a file store (no TCP port to pick, so parallel runs cannot
collide), calls ``fn(rank, n, *args)`` on each with ``threads`` intra-op threads, and returns the
ranks' return values in rank order. It is how the sharded tests, the sharded benchmark and the
FSDP2 Flower example (docs/sharded.md) run a multi-process job on one CPU machine. Starting a world
costs seconds (each process imports torch): do many things in one.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
from typing import Any, Callable, List, Optional

import torch

__all__ = ["run_local_world", "gloo_unavailable"]


def gloo_unavailable() -> Optional[str]:
    """None when this torch can run gloo process groups, else why not."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this build"
    if not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


def _entry(rank: int, fn: Callable, n: int, store: str, out_dir: str, threads: int, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120)
    )
    try:
        result = fn(rank, n, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_local_world(fn: Callable, n: int, *args: Any, threads: int = 1) -> List[Any]:
    """``[fn(0, n, *args), ..., fn(n - 1, n, *args)]``, each run in its own process of one gloo group.

    ``fn`` must be importable by name (a module-level function) and return something picklable. A
    failure on any rank raises here with that rank's traceback."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fedopt_world_") as tmp:
        mp.spawn(_entry, args=(fn, n, os.path.join(tmp, "store"), tmp, threads, args), nprocs=n, join=True)
        out = []
        for rank in range(n):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out
