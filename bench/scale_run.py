"""One measured ``fedopt-sim`` run for ``python -m bench scale``: ``python -m bench.scale_run FEDOPT-SIM ARGS``.

The run is built from ``fedopt-sim``'s own options (its parser and config), one seed, and timed in
phases: the set-up (data, model, streams: ``Simulation(...)``), each round, and the final
evaluation. It prints one JSON line: those seconds and, on a GPU, the peak device memory. The
parent (``bench/scale.py``) samples this process's resident memory from outside.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import List, Optional

import torch

from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.simulation import Simulation


def main(argv: Optional[List[str]] = None) -> int:
    parser = fedopt_sim.build_parser()
    parser.add_argument("--no-final", action="store_true", help="skip the final per-user evaluation")
    args = parser.parse_args(argv)
    args.dataset = args.dataset or fedopt_sim.default_dataset()
    cfg = fedopt_sim.config_from_args(args, args.seeds[0])
    torch.set_num_threads(1 if args.threads is None else args.threads)
    store = args.client_state_dir
    with tempfile.TemporaryDirectory(dir=store) if store else _nothing() as folder:
        start = time.perf_counter()
        sim = Simulation(cfg, client_state_dir=folder)
        setup_s = time.perf_counter() - start
        rounds = []
        for t in range(cfg.rounds):
            rec = sim.run_round(t)
            rounds.append(rec["seconds"])
        final_s = None
        if not args.no_final:
            start = time.perf_counter()
            sim.final_evaluation()
            final_s = time.perf_counter() - start
        device = sim.device
        out = {
            "setup_s": setup_s,
            "round_s": rounds,
            "final_s": final_s,
            "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "store_bytes": _disk_bytes(folder) if folder else 0,
            "val_acc": sim.history[-1].get("val_acc"),
            "trained_at_once": 1 if sim.batched is None else sim.batched.size,
        }
    print("SCALE " + json.dumps(out), flush=True)
    return 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _disk_bytes(folder: str) -> int:
    """Disk space the store's files take (sparse: only written slots count)."""
    import os

    total = 0
    for root, _, names in os.walk(folder):
        for n in names:
            total += os.stat(os.path.join(root, n)).st_blocks * 512
    return total


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
