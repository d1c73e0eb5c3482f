"""Run every algorithm variant, one client after another and client-batched, on this process's rank of
a torchrun group (or on one process without torchrun), and write each run's result as JSON.

``python tests/ranks_child.py OUT_DIR [VARIANT[:SERVER_OPTIMIZER] ...]``: rank 0 writes
``OUT_DIR/<variant>[:<server optimizer>]-<mode>.json``
(the per-round records without their times, the final evaluation, the final model's and server
state's digest); with ``FEDOPT_TEST_UNEVEN=1`` in the environment,
the clients' steps differ. tests/test_sim_ranks.py starts it under ``torchrun --nproc-per-node 2`` and alone,
and compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

import torch

from fedopt_kernels.sim.config import VARIANTS, SimConfig
from fedopt_kernels.sim.ranks import Ranks
from fedopt_kernels.sim.resume import tensor_digest
from fedopt_kernels.sim.simulation import Simulation

MODES = {"sequential": 1, "client-batched": 3}
# FEDOPT_TEST_UNEVEN=1: clients that differ in their work (each rank's share balanced by its steps)
UNEVEN: Dict[str, Any] = {}
if os.environ.get("FEDOPT_TEST_UNEVEN") == "1":
    UNEVEN.update(local_steps_range=(1, 6), stragglers=0.4)


def config(variant: str, batched: int) -> SimConfig:
    variant, _, server = variant.partition(":")
    return SimConfig(
        algorithm=variant,
        server_optimizer=server or "sgd",
        dataset="synthetic",
        model="mlp",
        hidden=16,
        clients=16,
        holdout_fraction=0.25,
        clients_per_round=5,
        rounds=3,
        local_steps=3,
        batch_size=8,
        finetune_steps=2,
        device="cpu",
        backend="auto",
        client_batched=batched,
        formulations="default",
        **UNEVEN,
    )


def main() -> int:
    out = Path(sys.argv[1])
    variants = sys.argv[2:] or list(VARIANTS)
    torch.set_num_threads(1)
    ranks = Ranks.from_environment("cpu")
    for variant in variants:
        for mode, batched in MODES.items():
            store = out / f"state-{variant}-{mode}"
            sim = Simulation(config(variant, batched), client_state_dir=store, ranks=ranks)
            result = sim.run()
            state = [t for key in sorted(sim.strategy.state) for t in sim.strategy.state[key]]
            state += sim.strategy.server.tensors()
            if ranks.main:
                record = {
                    "history": [{k: v for k, v in r.items() if k != "seconds"} for r in result["history"]],
                    "final": result["final"],
                    "ranks": result["ranks"],
                    "model": tensor_digest(sim.global_params),
                    "state": tensor_digest(state),
                    "params": [p.tolist() for p in sim.global_params],
                }
                (out / f"{variant}-{mode}.json").write_text(json.dumps(record))
            ranks.barrier()
    ranks.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every result is written and the process group destroyed: leave without the interpreter's
    # teardown, where gloo's worker threads have been seen to abort a rank on a loaded machine
    # ("terminate called without an active exception") after its work was done.
    os._exit(code)
